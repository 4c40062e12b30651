"""The ``ray`` launcher: the job's DAG workers as actors on an existing Ray cluster.

    distflow run CONFIG --ray auto|HOST:PORT|ray://HOST:10001      (or spec.ray.address)

    driver (this process)                    Ray cluster
    ---------------------                    -----------
    preflight (plan, data, reward)
    placement group: one bundle per  ----->  Ray node A: bundle 0 = distflow node 0
      distflow node, STRICT_SPREAD             actor rank 0 .. procsPerNode-1  (node buffer 0)
                                             Ray node B: bundle 1 = distflow node 1
                                               actor rank procsPerNode ..       (node buffer 1)
    rank 0's actor: rendezvous addr/port
    each node's first actor: model dir
    every actor: PET_*/MASTER_* env, then the unchanged run_worker
    ray.wait on the runs; progress from a queue; first failure -> kill all, release the group

Ray only places the processes: the workers rendezvous over torch.distributed
as in a pod and the batch never passes through Ray or the driver.

Why one bundle per distflow node rather than one per worker: a distflow node's
workers must share one machine (they hand data over through the node's shared
memory buffer), and Ray's strategies cannot say "these k bundles together,
those k elsewhere" (PACK is best effort, STRICT_PACK puts every bundle on one
machine). A bundle of ``procsPerNode`` workers' resources, bundles spread over
distinct Ray nodes (STRICT_SPREAD), says exactly that; each actor then takes
its worker's share of its node's bundle.

Deliberately simple: the checkpoint directory and ``trainer.logDir`` must be a
path every Ray node and the driver share (one machine, or a shared volume), as
with the operator's pods; the driver sets a previous run aside (``--no-resume``)
in that path.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass

from distflow.errors import DistflowConfigError, LaunchError, UserFunctionError
from distflow.spec import JobSpec

FAILURE_GRACE_SECONDS = 3.0
"""After the first failed worker, how long to collect the others' errors: a lost process is reported
before its peers' collective errors (they follow from it), whichever Ray saw first."""
POLL_SECONDS = 0.5
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
"""Ray colours the task name in an error; the message goes to logs and termination messages."""


@dataclass(frozen=True)
class RayResources:
    """What one worker's actor reserves (Ray's units: CPUs, GPUs, custom resources)."""

    num_cpus: float
    num_gpus: float
    custom: dict[str, float]

    def bundle(self, num_workers: int) -> dict[str, float]:
        """The placement-group bundle of ``num_workers`` such workers (zero entries left out:
        Ray rejects them)."""
        total = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        return {name: amount * num_workers for name, amount in total.items() if amount > 0}


def worker_resources(spec: JobSpec) -> RayResources:
    """One worker's Ray resources from ``spec.ray`` and ``spec.cluster``.

    Raises:
        DistflowConfigError: ``cluster.device: cuda`` with no GPU per worker, or a GPU job (cuda or
            auto) whose workers would get a fraction of a GPU: Ray would then put two ranks on one
            GPU, where NCCL cannot run two ranks of one group and the ranks share its memory.
    """
    cluster, ray_spec = spec.cluster, spec.ray
    gpus = ray_spec.gpus_per_worker
    if gpus is None:
        if cluster.accelerators_per_node:
            gpus = cluster.accelerators_per_node / cluster.procs_per_node
        else:
            gpus = 1.0 if cluster.device == "cuda" else 0.0
    if cluster.device == "cuda" and gpus == 0:
        raise DistflowConfigError("spec.ray.gpusPerWorker: 0 GPUs per worker but cluster.device is cuda; "
                                  "give each worker a GPU (gpusPerWorker: 1) or use device cpu")
    if cluster.device != "cpu" and gpus != int(gpus):
        raise DistflowConfigError(_fractional_gpus_message(spec, gpus))
    return RayResources(num_cpus=ray_spec.cpus_per_worker, num_gpus=gpus, custom=dict(ray_spec.resources))


def _fractional_gpus_message(spec: JobSpec, gpus: float) -> str:
    cluster = spec.cluster
    if spec.ray.gpus_per_worker is not None:
        setting = f"spec.ray.gpusPerWorker: {gpus:g} GPUs per worker"
    else:
        setting = (f"spec.cluster.acceleratorsPerNode: {cluster.accelerators_per_node} GPUs for procsPerNode="
                   f"{cluster.procs_per_node} workers give each {gpus:g} (the default of ray.gpusPerWorker)")
    return (f"{setting}: each worker needs whole GPUs of its own, since a fraction lets Ray place two ranks on "
            f"one GPU (NCCL cannot run two ranks of a group on one device). Give each worker 1 GPU "
            f"(ray.gpusPerWorker: 1, or cluster.acceleratorsPerNode: {cluster.procs_per_node}), or use "
            "cluster.device: cpu")


def placement_shortfall(bundle: dict[str, float], num_nodes: int, nodes: list[dict],
                        label_selector: dict[str, str] | None = None) -> str:
    """Why ``num_nodes`` bundles, one per Ray node, do not fit: the sentence a timeout reports.

    Args:
        bundle: one distflow node's resources (``RayResources.bundle``).
        nodes: the alive Ray nodes as ``{"resources": {...total...}, "labels": {...}}``.

    Returns:
        e.g. ``"1 of the 2 Ray nodes it needs can hold one: GPU: needs 2 per node, the most any Ray
        node has is 0"``.
    """
    label_selector = label_selector or {}
    labelled = [n for n in nodes if all(n.get("labels", {}).get(k) == v for k, v in label_selector.items())]
    fitting = [n for n in labelled if all(n["resources"].get(r, 0) >= amount for r, amount in bundle.items())]
    head = (f"{len(fitting)} of the {num_nodes} Ray nodes it needs can hold one "
            f"({len(nodes)} alive Ray nodes")
    head += f", {len(labelled)} with labels {label_selector})" if label_selector else ")"
    if len(fitting) >= num_nodes:
        return head + ": the resources exist but other work holds them; wait, or free them"
    if label_selector and len(labelled) < num_nodes:
        return head + f": too few Ray nodes carry the labels {label_selector} (ray start --labels)"
    reasons = []
    for name, amount in bundle.items():
        most = max((n["resources"].get(name, 0) for n in labelled), default=0)
        enough = sum(n["resources"].get(name, 0) >= amount for n in labelled)
        if enough < num_nodes:
            reasons.append(f"{name}: needs {amount:g} per node on {num_nodes} nodes, {enough} have it "
                           f"(the most any Ray node has is {most:g})")
    return head + ": " + "; ".join(reasons)


class RayWorker:
    """One DAG worker as a Ray actor: the launcher gives it the torchrun-style environment, then
    it runs the unchanged ``run_worker``."""

    def where(self) -> dict:
        """This actor's Ray node, host address and pid (for the launch log and failure messages)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port on its own host for torch.distributed's store."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def prepare(self, spec: JobSpec) -> str:
        """A node's first worker: the model resolved on this Ray node (once per node, like a pod),
        and the prompts and the rollout engine checked against it. Returns the model directory."""
        from distflow.launcher import check_against_model, resolve_model_dir

        model_dir = resolve_model_dir(spec)
        check_against_model(spec, model_dir)
        return model_dir

    def run(self, spec: JobSpec, job_name: str, environ: dict[str, str], progress_queue=None):
        """Train: ``environ`` holds PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, MASTER_ADDR,
        MASTER_PORT (what the env launcher reads) and LOCAL_RANK, RANK, WORLD_SIZE.

        Returns:
            This worker's metrics history (``run_worker``).
        """
        from distflow.entry import run_worker

        os.environ.update(environ)
        env = worker_env_from_environ(spec, job_name, os.environ)
        progress = None
        if progress_queue is not None:
            def progress(step, metrics):
                progress_queue.put_nowait((step, dict(metrics)))
        return run_worker(spec, env, progress)


def worker_env_from_environ(spec: JobSpec, job_name: str, environ):
    """The ``WorkerEnv`` of one worker from torchrun-style variables (the env launcher's, plus
    LOCAL_RANK and DISTFLOW_MODEL_DIR).

    A Ray actor sees only the GPUs Ray gave it (CUDA_VISIBLE_DEVICES), so its device index is 0.
    The node's first worker serves Prometheus on DISTFLOW_METRICS_PORT (0: none).
    """
    from distflow.launcher import node_env_from_environ
    from distflow.worker import WorkerEnv

    node = node_env_from_environ(environ)
    nproc, node_rank = int(node["PET_NPROC_PER_NODE"]), int(node["PET_NODE_RANK"])
    local_rank = int(environ["LOCAL_RANK"])
    port = int(environ.get("DISTFLOW_METRICS_PORT", "0"))
    return WorkerEnv(rank=node_rank * nproc + local_rank, world_size=int(node["PET_NNODES"]) * nproc,
                     local_rank=local_rank, local_world_size=nproc, node_rank=node_rank,
                     num_nodes=int(node["PET_NNODES"]), master_addr=str(node["MASTER_ADDR"]),
                     master_port=int(node["MASTER_PORT"]), job_name=job_name,
                     model_dir=environ["DISTFLOW_MODEL_DIR"], device_index=0,
                     resume=environ.get("DISTFLOW_RESUME", "1") == "1",
                     metrics_port=port if local_rank == 0 else 0)


def metrics_ports(base_port: int, node_hosts: list[str]) -> list[int]:
    """Each distflow node's Prometheus port: ``base_port`` on its host, the next free one when
    earlier nodes share the host (Ray nodes on one machine, as in a test); all 0 when off."""
    if not base_port:
        return [0] * len(node_hosts)
    return [base_port + node_hosts[:i].count(host) for i, host in enumerate(node_hosts)]


def torchrun_environ(spec: JobSpec, rank: int, master: tuple[str, int], model_dir: str,
                     resume: bool, metrics_port: int = 0) -> dict[str, str]:
    """The variables worker ``rank`` gets: the operator's pod env plus the per-process ones."""
    nproc = spec.cluster.procs_per_node
    node_rank, local_rank = divmod(rank, nproc)
    return {"DISTFLOW_METRICS_PORT": str(metrics_port), "PET_NNODES": str(spec.cluster.num_nodes), "PET_NODE_RANK": str(node_rank),
            "PET_NPROC_PER_NODE": str(nproc), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(spec.world_size),
            "DISTFLOW_MODEL_DIR": model_dir, "DISTFLOW_RESUME": "1" if resume else "0"}


def launch_ray(spec: JobSpec, job_name: str, address: str, resume: bool = True, progress: bool = True) -> None:
    """Run the job's workers as actors on the Ray cluster at ``address`` (blocks until they exit).

    Raises:
        DistflowConfigError: before anything is reserved (plan, data, reward function, GPUs).
        LaunchError: no cluster at ``address``; the placement group not placed within
            ``spec.ray.placementTimeoutSeconds`` (the message says what is missing); a worker
            failed or its actor or Ray node was lost (the message carries the worker's error).
            Every actor and the placement group are released before it is raised.
    """
    from distflow.checkpoint_origin import check_resume
    from distflow.launcher import nothing_to_train, set_aside_previous_run
    from distflow.preflight import preflight

    preflight(spec)
    resources = worker_resources(spec)
    if resume and spec.checkpoint.resume != "never" and nothing_to_train(spec):
        return  # before the cluster is reached: no actor starts, nothing is reserved
    try:
        import ray
    except ImportError:
        raise DistflowConfigError("spec.ray.address (--ray): the ray launcher needs Ray in this environment; "
                                  "install it (pip install 'distflow[ray]') or run without --ray") from None

    started_here = not ray.is_initialized()
    if started_here:
        unreachable = gcs_unreachable(address)
        if unreachable:  # Ray itself retries a dead GCS address for many minutes
            raise LaunchError(f"no Ray cluster at {address!r}: {unreachable}. Start one (ray start --head) or "
                              "give its address: --ray HOST:PORT")
        try:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise LaunchError(f"no Ray cluster at {address!r}: {err}. Start one (ray start --head) or give "
                              "its address: --ray HOST:PORT") from None
    try:
        if not resume or spec.checkpoint.resume == "never":
            set_aside_previous_run(spec)
        else:  # the model is resolved on each Ray node: its source and the critic are compared here
            check_resume(spec, None)
        _run_on_cluster(spec, job_name, resources, resume, progress)
    finally:
        if started_here:
            ray.shutdown()


def gcs_unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why no Ray cluster can answer at ``address``, from one TCP connect to its GCS port; None
    when something answers, or when the address is not HOST:PORT (``ray://`` clients time out
    by themselves; a malformed address is Ray's to reject).

    ``auto`` is what Ray would resolve it to: ``RAY_ADDRESS``, else the address file the last
    ``ray start`` on this machine wrote (left behind when that cluster was killed).
    """
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            current = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "ray_current_cluster"
            address = current.read_text().strip() if current.is_file() else ""
        if not address:  # else Ray answers with its own text about an --address flag distflow has not
            return ("no Ray cluster was started on this machine (RAY_ADDRESS is unset and no `ray start` "
                    "left an address)")
    host, sep, port = address.rpartition(":")
    if not sep or not host or address.startswith("ray://") or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as err:
        return f"nothing answers at {host}:{port} ({err.strerror or err})"


def _run_on_cluster(spec: JobSpec, job_name: str, resources: RayResources, resume: bool, progress: bool):
    import ray
    from ray.util.placement_group import remove_placement_group

    group = _reserve(spec, resources)
    actors, queue = [], None
    try:
        actors = _start_actors(spec, group, resources)
        try:
            places = ray.get([a.where.remote() for a in actors])
            for rank, place in enumerate(places):
                print(f"distflow: rank {rank} (node {rank // spec.cluster.procs_per_node}) on Ray node "
                      f"{place['node_id'][:12]} {place['ip']}, pid {place['pid']}", flush=True)
            master = ray.get(actors[0].rendezvous.remote())
            leads = actors[::spec.cluster.procs_per_node]
            model_dirs = ray.get([lead.prepare.remote(spec) for lead in leads])
        except ray.exceptions.RayActorError as err:
            raise LaunchError(f"a worker's actor was lost before training started: {err}") from None
        if progress:
            from ray.util.queue import Queue

            queue = Queue(actor_options={"num_cpus": 0})
        node_hosts = [place["ip"] for place in places[::spec.cluster.procs_per_node]]
        ports = metrics_ports(spec.trainer.metrics_port, node_hosts)
        runs = {}
        for rank, actor in enumerate(actors):
            node_rank = rank // spec.cluster.procs_per_node
            environ = torchrun_environ(spec, rank, master, model_dirs[node_rank], resume, ports[node_rank])
            runs[actor.run.remote(spec, job_name, environ, queue if rank == 0 else None)] = rank
        _wait(spec, runs, places, queue)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if queue is not None:
            queue.shutdown(force=True)
        remove_placement_group(group)


def _reserve(spec: JobSpec, resources: RayResources):
    """The placement group: one bundle per distflow node, on distinct Ray nodes.

    Raises:
        LaunchError: not placed within ``spec.ray.placementTimeoutSeconds`` (group removed).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    num_nodes = spec.cluster.num_nodes
    bundle = resources.bundle(spec.cluster.procs_per_node)
    selector = dict(spec.ray.label_selector)
    group = placement_group([bundle] * num_nodes, strategy="STRICT_SPREAD",
                            bundle_label_selector=[selector] * num_nodes if selector else None)
    timeout = spec.ray.placement_timeout_seconds
    deadline = time.monotonic() + timeout
    try:
        # short waits: Ctrl-C (KeyboardInterrupt) gets through between them, not only at the deadline
        while time.monotonic() < deadline:
            if group.wait(timeout_seconds=max(0.1, min(1.0, deadline - time.monotonic()))):
                return group
    except BaseException:
        remove_placement_group(group)
        raise
    remove_placement_group(group)
    nodes = [{"resources": n.get("Resources", {}), "labels": n.get("Labels", {})}
             for n in ray.nodes() if n.get("Alive")]
    raise LaunchError(
        f"the Ray cluster did not place the job within {timeout}s (spec.ray.placementTimeoutSeconds): "
        f"{num_nodes} distflow nodes of {bundle} each, one per Ray node (cluster.numNodes x "
        f"cluster.procsPerNode workers; spec.ray sets each worker's share). "
        + placement_shortfall(bundle, num_nodes, nodes, selector))


def _start_actors(spec: JobSpec, group, resources: RayResources) -> list:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_class = ray.remote(RayWorker)
    actors = []
    for rank in range(spec.world_size):
        strategy = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank // spec.cluster.procs_per_node)
        actors.append(actor_class.options(
            num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, resources=resources.custom,
            scheduling_strategy=strategy, max_restarts=0).remote())
    return actors


def _wait(spec: JobSpec, runs: dict, places: list[dict], queue) -> None:
    """Until every run returns; on the first failure, the errors of all that fail within
    FAILURE_GRACE_SECONDS, as one LaunchError (the caller then kills the rest)."""
    import ray
    from ray.exceptions import RayActorError

    printer = None
    if queue is not None:
        from distflow.progress import progress_printer

        printer = progress_printer(spec.trainer.total_steps)
    pending, failures, failed_at = list(runs), [], None
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
        for ref in done:
            try:
                ray.get(ref)
            except (RayActorError, ray.exceptions.RayTaskError) as err:
                failures.append((runs[ref], err))
                failed_at = failed_at or time.monotonic()
        _show_progress(queue, printer)
        if failed_at is not None and (not pending or time.monotonic() - failed_at > FAILURE_GRACE_SECONDS):
            break
    if printer is not None:
        printer.close()
    if failures:
        if (user_error := user_function_failure(failures)) is not None:
            raise user_error
        raise LaunchError(failure_message(failures, places, RayActorError))


def _show_progress(queue, printer) -> None:
    while queue is not None and not queue.empty():
        printer(*queue.get_nowait())


def user_function_failure(failures: list) -> UserFunctionError | None:
    """The first worker error that is a user's function raising (Ray wraps it as the cause of a
    RayTaskError), to fail the job with its message alone, as the local launcher does."""
    for _, err in failures:
        cause = getattr(err, "cause", None)
        if isinstance(cause, UserFunctionError):
            return UserFunctionError(str(cause))
    return None


def failure_message(failures: list, places: list[dict], actor_error: type) -> str:
    """Lost actors (process or Ray node gone) first, in full: their peers' errors follow from them
    (a collective whose peer vanished), so those get their last line only."""
    failures = sorted(failures, key=lambda f: (not isinstance(f[1], actor_error), f[0]))
    lines = []
    for index, (rank, err) in enumerate(failures):
        place = places[rank]
        what = "lost (its process or Ray node died)" if isinstance(err, actor_error) else "failed"
        text = ANSI_ESCAPE.sub("", str(err)).strip()
        if index:
            text = text.splitlines()[-1] if text else text
        lines.append(f"rank {rank} on Ray node {place['node_id'][:12]} {place['ip']} (pid {place['pid']}) "
                     f"{what}: {text}")
    return f"{len(failures)} worker(s) stopped; the job was stopped and its actors released.\n" + "\n".join(lines)
