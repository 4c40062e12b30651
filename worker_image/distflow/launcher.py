"""Launchers: how the DAG workers come to exist.

- ``local`` (``distflow run``): ``numNodes x procsPerNode`` worker processes
  on this machine; a "node" is a group of processes with its own node buffer.
- ``env`` (``distflow node``, what a pod runs): this node's workers, from the
  torchrun-style variables the operator sets: PET_NNODES, PET_NODE_RANK,
  PET_NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT.

The model is resolved (converted from GGUF, built, or found) once per node
before any worker starts, so a bad model path fails before training starts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path

from distflow.checkpoint_origin import check_resume
from distflow.errors import DistflowConfigError, UserFunctionError
from distflow.preflight import check_prompt_lengths, preflight
from distflow.progress import StepLinePrinter, progress_printer
from distflow.resize import (EXIT_LEFT_POOL, EXIT_RESIZE, JOIN_ENV, RESIZE_KEY, LeftPool, ResizeRequest,
                             StoppedForResize, read_request)
from distflow.spec import JobSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID_CONFIG = 2  # the operator fails fast on this: retrying cannot help


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_model_dir(spec: JobSpec) -> str:
    """Local directory of the model (converting/building into the cache once).

    Raises:
        DistflowConfigError: the model path cannot be resolved.
    """
    from distflow.models import model_cache_dir, model_source_problem, resolve_model, resolved_model_dir

    cache, source = model_cache_dir(), spec.model.path
    made_here = (source == "smollm2" or source.startswith(("gguf:", "tiny"))) and not Path(source).is_dir()
    if made_here and not model_source_problem(source) and resolved_model_dir(source, cache) is None:
        print(f"distflow: preparing model.path {source!r} once (converted or built into {cache}; later runs "
              "reuse it)", flush=True)
    try:
        return str(resolve_model(spec.model.path, cache))
    except (ValueError, FileNotFoundError) as err:
        raise DistflowConfigError(f"spec.model.path: {err}") from None


def check_against_model(spec: JobSpec, model_dir: str) -> None:
    """What can be checked once the model is on disk, before any worker starts: the data's
    prompts against ``data.maxPromptLength`` and the rollout engine against the model.

    Raises:
        DistflowConfigError: naming the field and the fix.
    """
    check_prompt_lengths(spec, model_dir)
    check_rollout_engine(spec, model_dir)


def check_rollout_engine(spec: JobSpec, model_dir: str) -> None:
    """``rollout.engine: vllm``: vLLM importable and able to load the model, before any worker starts.

    Raises:
        DistflowConfigError: naming the field and the fix.
    """
    if spec.rollout.engine == "hf":
        return
    import torch

    from distflow.engines.vllm_rollout import engine_problems

    cuda = spec.cluster.device == "cuda" or (spec.cluster.device == "auto" and torch.cuda.is_available())
    if problems := engine_problems(spec, model_dir, "cuda" if cuda else "cpu"):
        raise DistflowConfigError("\n".join(f"spec.{p}" for p in problems))


def spawn_workers(main, args: tuple, num_workers: int) -> None:
    """Start ``num_workers`` processes running ``main(index, *args)`` and wait for them all.

    Raises:
        UserFunctionError: a worker's user function raised: its message, which names the function,
            the sample and the step, without the spawn machinery's traceback.
        StoppedForResize: the workers stopped at a step boundary for a resize (``EXIT_RESIZE``).
        LeftPool: a worker left the rollout pool in an in-place shrink (``EXIT_LEFT_POOL``).
        torch.multiprocessing.ProcessRaisedException: any other worker failure (the others are stopped).
    """
    import torch.multiprocessing as mp

    try:
        mp.spawn(main, args=args, nprocs=num_workers, join=True)
    except mp.ProcessExitedException as err:
        if err.exit_code == EXIT_LEFT_POOL:
            raise LeftPool(f"worker {err.error_index} left in an in-place shrink at a step boundary") from None
        if err.exit_code != EXIT_RESIZE:
            raise
        raise StoppedForResize(f"worker {err.error_index} stopped at a step boundary for a resize "
                               "(checkpoint saved)") from None
    except mp.ProcessRaisedException as err:
        marker = f"{UserFunctionError.__module__}.{UserFunctionError.__qualname__}: "
        text = str(err)
        if marker not in text:
            raise
        raise UserFunctionError(text[text.rindex(marker) + len(marker):].strip()) from None


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the launcher dies (``kill`` of ``distflow run``),
    instead of living on, blocked in a collective, holding its memory."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def check_local_devices(spec: JobSpec, device_count: int) -> None:
    """A local CUDA run needs one GPU per worker: ``numNodes x procsPerNode`` on this machine.

    Args:
        device_count: GPUs this machine shows (``torch.cuda.device_count()``).

    Raises:
        DistflowConfigError: ``cluster.device`` is cuda (or auto, with GPUs) and there are fewer
            GPUs than workers.
    """
    cluster = spec.cluster
    if cluster.device == "cpu" or (cluster.device == "auto" and device_count == 0):
        return
    if device_count == 0:
        raise DistflowConfigError("spec.cluster.device: cuda requested but torch sees no GPU on this machine; "
                                  "use cpu or auto (--set cluster.device=auto)")
    if spec.world_size > device_count:
        raise DistflowConfigError(
            f"spec.cluster: numNodes={cluster.num_nodes} x procsPerNode={cluster.procs_per_node} = "
            f"{spec.world_size} local workers need {spec.world_size} GPUs; this machine shows {device_count} "
            f"(device: {cluster.device}). Lower cluster.numNodes / cluster.procsPerNode, or use device cpu "
            "(--set cluster.device=cpu)")


def check_node_devices(spec: JobSpec, device_count: int) -> None:
    """A pod's CUDA workers need one GPU each: ``procsPerNode`` visible to the pod.

    Raises:
        DistflowConfigError: as ``check_local_devices``, for this node's workers.
    """
    cluster = spec.cluster
    if cluster.device == "cpu" or (cluster.device == "auto" and device_count == 0):
        return
    if cluster.procs_per_node > device_count:
        raise DistflowConfigError(
            f"spec.cluster.procsPerNode={cluster.procs_per_node}: this pod sees {device_count} GPUs, one per "
            "worker is needed; set cluster.acceleratorsPerNode (the pod's GPU request) to procsPerNode")


def local_worker_env(index: int, per_node: int, base):
    """Worker ``index`` of a local run: node ``index // per_node``, and GPU ``index``: every "node"
    runs on this one machine, so GPUs are counted over all of them."""
    node_rank, local_rank = divmod(index, per_node)
    port = base.metrics_port + node_rank if base.metrics_port and local_rank == 0 else 0
    return replace(base, rank=index, local_rank=local_rank, node_rank=node_rank, device_index=index,
                   metrics_port=port)


def _local_worker_main(index: int, spec: JobSpec, base, with_progress: bool):
    """Worker ``index`` of a local run (``local_worker_env``)."""
    from distflow.entry import run_worker

    _die_with_parent()
    env = local_worker_env(index, spec.cluster.procs_per_node, base)
    progress = progress_printer(spec.trainer.total_steps) if with_progress and index == 0 else None
    run_worker(spec, env, progress)


def launch_local(spec: JobSpec, job_name: str, resume: bool = True, progress: bool = True) -> None:
    """Run the whole job on this machine (blocks until every worker exits).

    Raises:
        DistflowConfigError: before any worker starts, if the model cannot be resolved,
            ``cluster.device`` needs more GPUs than the machine has (``check_local_devices``), or
            the checkpoint to resume was made from another model or workflow (``check_resume``).
        UserFunctionError: a user's function raised in a worker (the others are stopped).
        torch.multiprocessing.ProcessRaisedException: a worker failed otherwise (the others are stopped).
    """
    import torch

    from distflow.worker import WorkerEnv

    preflight(spec)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_local_devices(spec, gpus)
    model_dir = resolve_model_dir(spec)  # a bad model path fails here, before the previous run is moved
    check_against_model(spec, model_dir)
    if not resume or spec.checkpoint.resume == "never":
        set_aside_previous_run(spec)
    elif not spec.checkpoint.dir:  # nothing to resume from: this run's logs must not extend an older run's
        set_aside_previous_run(spec, why="no checkpoint.dir to resume from")
    else:
        check_resume(spec, model_dir)
        if nothing_to_train(spec):
            return
    cluster = spec.cluster
    device = "cpu" if cluster.device == "cpu" or not gpus else "cuda"
    print(f"distflow: starting {spec.world_size} workers on this machine ({cluster.num_nodes} nodes x "
          f"{cluster.procs_per_node}, {device}); each imports torch and loads the model before the first step",
          flush=True)
    # Every worker shares this machine: local_world_size counts them all (CPU threads per worker).
    base = WorkerEnv(rank=0, world_size=spec.world_size, local_rank=0,
                     local_world_size=spec.world_size, node_rank=0, num_nodes=cluster.num_nodes,
                     master_addr="127.0.0.1", master_port=free_port(), job_name=job_name,
                     model_dir=model_dir, device_index=0, resume=resume, metrics_port=spec.trainer.metrics_port)
    spawn_workers(_local_worker_main, (spec, base, progress), spec.world_size)


def nothing_to_train(spec: JobSpec) -> bool:
    """Whether a resumed run has no step left: its newest complete checkpoint (checksums verified)
    is at or past trainer.totalSteps. Then it says so, and how to train on, and no worker need start."""
    from distflow import checkpoint

    if not spec.checkpoint.dir or not (done := checkpoint.finished(spec.checkpoint.dir, spec.trainer.total_steps)):
        return False
    where = "at" if done[1] == spec.trainer.total_steps else "past"
    print(f"distflow: nothing to train: the step-{done[1]} checkpoint in {spec.checkpoint.dir} is {where} "
          f"trainer.totalSteps ({spec.trainer.total_steps}); raise trainer.totalSteps above {done[1]} to "
          "train on, or --no-resume to start over", flush=True)
    return True


def set_aside_previous_run(spec: JobSpec, why: str = "--no-resume or checkpoint.resume: never") -> list[Path]:
    """Starting over (``--no-resume``, ``checkpoint.resume: never``): move an earlier run's
    checkpoints and logs out of the way.

    ``checkpoint.dir`` and the metrics, eval-sample and trained-ids files in
    ``trainer.logDir`` are renamed to ``<name>.previous`` (replacing an older ``.previous``), so
    the new run neither prunes its own first checkpoints as "older" than the
    old ones, nor resumes from the old run after a crash, nor mixes the two
    runs' metrics; the earlier run stays on disk until the next start-over.

    Returns:
        The paths moved (their new names).
    """
    import shutil

    from distflow import sample_ids

    candidates = [Path(spec.trainer.log_dir) / name
                  for name in ("metrics.jsonl", "eval_samples.jsonl", sample_ids.FILE)]
    if spec.checkpoint.dir:
        candidates.insert(0, Path(spec.checkpoint.dir))
    present = [path for path in candidates if path.exists()]
    if not present:
        return []
    for path in candidates:  # one previous run at a time: never a mix of two older ones
        old = path.with_name(path.name + ".previous")
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    moved = [path.rename(path.with_name(path.name + ".previous")) for path in present]
    print(f"distflow: starting over ({why}): the previous run was moved aside to " + ", ".join(map(str, moved)),
          flush=True)
    return moved


def node_env_from_environ(environ=os.environ) -> dict[str, int | str]:
    """The torchrun-style variables a pod gets from the operator.

    Raises:
        DistflowConfigError: a variable is missing or not an integer.
    """
    out: dict[str, int | str] = {}
    for name in ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "MASTER_PORT"):
        raw = environ.get(name)
        if raw is None or not raw.strip().isdigit():
            raise DistflowConfigError(f"env {name}: expected an integer, got {raw!r}; the operator sets it")
        out[name] = int(raw)
    addr = environ.get("MASTER_ADDR")
    if not addr:
        raise DistflowConfigError("env MASTER_ADDR: missing; the operator sets it to node 0's DNS name")
    out["MASTER_ADDR"] = addr
    return out


def spec_at_pod_size(spec: JobSpec, pet_nnodes: int, request: ResizeRequest | None) -> JobSpec:
    """The spec a running gang's pod starts with: at its ``PET_NNODES`` when the mounted spec is at
    the size of an in-place resize the operator asked for after it created the pod (the ConfigMap's
    spec and request reached the volume before the pod read it); the gang starts at its size and
    re-forms at the new one at a step boundary (``distflow.gang_resize``). Otherwise ``spec``."""
    if (request is None or not request.in_place or request.num_nodes != spec.cluster.num_nodes
            or pet_nnodes == spec.cluster.num_nodes):
        return spec
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"num_nodes": pet_nnodes})})


def launch_node(spec: JobSpec, job_name: str, environ=os.environ, spec_dir: str | Path | None = None) -> None:
    """Start this node's workers from the pod's environment (blocks).

    ``spec_dir``: the mounted ConfigMap's directory; its key ``resize`` is the operator's resize
    request (``distflow.resize``), polled at every step boundary. None: no request is polled.
    ``DISTFLOW_JOIN=1`` in the environment: this node's workers join the running job's rollout pool
    (``distflow.pools.elastic``); ``PET_NNODES`` and the spec are then the sizes it grows to.

    Raises:
        DistflowConfigError: env and spec disagree (numNodes, procsPerNode), the pod
            has fewer GPUs than workers, the model cannot be resolved, or the checkpoint to
            resume was made from another model or workflow.
        UserFunctionError: a user's function raised in one of this node's workers.
        StoppedForResize: the workers stopped for a resize (checkpoint saved).
    """
    import torch

    from distflow.worker import WorkerEnv

    env = node_env_from_environ(environ)
    nnodes, node_rank, nproc = env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]
    join = environ.get(JOIN_ENV, "") == "1"
    if spec_dir is not None and not join:
        given, spec = spec, spec_at_pod_size(spec, nnodes, read_request(Path(spec_dir) / RESIZE_KEY))
        if spec is not given and node_rank == 0:
            print(f"distflow: the job is resizing in place to {given.cluster.num_nodes} nodes; this gang starts at "
                  f"its {nnodes} (PET_NNODES) and re-forms at a step boundary", flush=True)
    if nnodes != spec.cluster.num_nodes or nproc != spec.cluster.procs_per_node:
        raise DistflowConfigError(
            f"env PET_NNODES={nnodes}, PET_NPROC_PER_NODE={nproc} disagree with spec.cluster "
            f"(numNodes={spec.cluster.num_nodes}, procsPerNode={spec.cluster.procs_per_node})")
    if not 0 <= node_rank < nnodes:
        raise DistflowConfigError(f"env PET_NODE_RANK={node_rank}: must be in [0, {nnodes})")
    preflight(spec)
    check_node_devices(spec, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    model_dir = resolve_model_dir(spec)
    check_against_model(spec, model_dir)
    check_resume(spec, model_dir)
    port = int(environ.get("DISTFLOW_METRICS_PORT", spec.trainer.metrics_port or 0))
    base = WorkerEnv(rank=node_rank * nproc, world_size=nnodes * nproc, local_rank=0,
                     local_world_size=nproc, node_rank=node_rank, num_nodes=nnodes,
                     master_addr=str(env["MASTER_ADDR"]), master_port=int(env["MASTER_PORT"]),
                     job_name=job_name, model_dir=model_dir, device_index=0, metrics_port=0,
                     resize_file=str(Path(spec_dir) / RESIZE_KEY) if spec_dir is not None else "",
                     join=join)
    spawn_workers(_node_worker_main, (spec, base, nproc, port), nproc)


def _node_worker_main(local_rank: int, spec: JobSpec, base, nproc: int, port: int):
    from distflow.entry import run_worker

    # Only the node's first worker serves metrics, on the pod's port.
    env = replace(base, rank=base.rank + local_rank, local_rank=local_rank, device_index=local_rank,
                  metrics_port=port if local_rank == 0 else 0)
    # Every rank holds the step's reduced metrics: each pod's first worker prints them, so
    # `kubectl logs` of any node pod shows the run's progress.
    run_worker(spec, env, StepLinePrinter(spec.trainer.total_steps) if local_rank == 0 else None)


def job_name_for(config_path: str | Path) -> str:
    return os.environ.get("DISTFLOW_JOB_NAME") or Path(config_path).stem
