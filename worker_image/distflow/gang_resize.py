"""In-place resize of the whole gang (a job without pools): the running pods stay, the world re-forms.

    step boundary (every rank of world g, after the step's checkpoint, ``GangResize.at_step_boundary``)
      each rank reads the request file --all_gather [inPlace, numNodes, ready]--> ``agree``
      (pure: the lowest rank's in-place read of another size wins; ready is rank 0's count of the
      joiners registered in the job's store for world g+1)
      none, or a size the spec cannot take: go on
      grow to N' nodes: once every joiner is ready (until then: go on at N, poll again next step)
      then   the checkpoint of this step (saved here if the schedule did not), rank 0 announces
             world g+1 (its size to the joiners of a grow, 0 to any of a shrink), ``train`` returns
    ``reform`` (the worker's process, after ``train``)
      ranks >= W'  leave: exit with EXIT_LEFT_POOL (the operator deletes their pods)
      ranks <  W'  close the worker, re-form world g+1 on the job's store (rank 0's TCPStore, a key
                   prefix per world), and build the worker again in the same process, which resumes
                   the checkpoint at the new world size
    joiner (a pod started with DISTFLOW_JOIN=1, PET_NNODES and its spec at the new size; ``join``)
      serves its metrics (the pod is Ready), registers for world g+1, waits for the running ranks to
      form it, joins it, builds its worker, which resumes the same checkpoint

The ranks are node-major, so a grow appends ranks and a shrink drops the highest: no running rank
changes rank. The state crosses the resize through the checkpoint, read at the new world size as a
restart would read it, so an in-place resize trains exactly what a job stopped and resumed by hand
at the same step trains (the tests compare the parameters bit for bit); what it saves is the pods:
no container exits, no pod is created again, nothing imports torch again but the joiners, whose
start overlaps the steps trained meanwhile.

Only the hf rollout engine resizes in place: a colocated vLLM engine's workers would need their
engine torn down and built again; such a job stops for the resize instead (``distflow.resize``),
as does a job with pools (``distflow.pools.elastic`` resizes its rollout pool in place).
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from distflow import process_group
from distflow.exporter import NodeExporter
from distflow.resize import EXIT_LEFT_POOL, ResizeRequest, read_request
from distflow.spec import JobSpec
from distflow.spec.validation import size_problems


def agree(reads: Sequence[ResizeRequest | None], num_nodes: int) -> int | None:
    """The gang's next node count from every rank's read of the request, in rank order (pure: every
    rank computes it from the same all-gathered reads). A ConfigMap update reaches the nodes at
    different moments, so ranks may read an older request, or none: the lowest rank's read that
    asks for an in-place resize to another size than ``num_nodes`` wins. None: go on."""
    for request in reads:
        if request is not None and request.in_place and request.num_nodes != num_nodes:
            return request.num_nodes
    return None


def resized_spec(spec: JobSpec, num_nodes: int) -> tuple[JobSpec, list[str]]:
    """``spec`` (as given: its device defaults not settled, ``spec.defaults``) at ``num_nodes`` nodes,
    and the spec's problems at that size (empty: it takes it)."""
    resized = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"num_nodes": num_nodes})})
    return resized, list(size_problems(resized))


class GangResize:
    """Polled by every rank of a job without pools at each step boundary: resize the gang in place.

    Args:
        path: the mounted request file (``<spec dir>/resize``, ``distflow.resize``).
        num_nodes: the gang's nodes now.
        procs_per_node: workers per node.
        store: the job's store (``process_group.world_store``, or a joiner's ``join_store``).
        generation: the world's generation (``process_group.GENERATION_KEY``).
    """

    def __init__(self, path: Path | str, num_nodes: int, procs_per_node: int, store, generation: int = 0):
        self.path, self.num_nodes, self.procs_per_node = Path(path), num_nodes, procs_per_node
        self.store, self.generation = store, generation
        self._said: int | None = None
        """The size the last waiting or refusal line was about (each is said once)."""

    @staticmethod
    def takes(spec: JobSpec) -> bool:
        """Whether a job of ``spec`` resizes in place: no pools, and the hf rollout engine."""
        return not spec.async_.enable and spec.rollout.engine == "hf"

    @classmethod
    def for_worker(cls, worker) -> "GangResize":
        """The poll of a ``DagWorker`` on its world; rank 0 of a job's first world publishes it."""
        env = worker.env
        store = process_group.world_store()
        if env.rank == 0 and not env.formed:
            store.set(process_group.GENERATION_KEY, str(env.generation))
        return cls(env.resize_file, env.num_nodes, worker.spec.cluster.procs_per_node, store, env.generation)

    def poll(self, worker) -> int | None:
        """The node count the gang re-forms at now, or None. Collective over the world: one
        all-gather of 3 integers per rank."""
        request = read_request(self.path)
        ready = self.store.add(process_group.world_key(self.generation + 1, "ready"), 0) if worker.rank == 0 else 0
        mine = [1, request.num_nodes] if request is not None and request.in_place else [0, 0]
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor([*mine, int(ready)], dtype=torch.int64))
        target = agree([ResizeRequest(int(r[1]), in_place=True) if r[0] else None for r in rows], self.num_nodes)
        if target is None:
            return None
        _, problems = resized_spec(worker.given, target)
        joiners = (target - self.num_nodes) * self.procs_per_node
        if problems or int(rows[0][2]) < joiners:
            if worker.is_logger and self._said != target:
                why = ("; ".join(problems) + f"; the gang goes on at {self.num_nodes} nodes") if problems else (
                    f"once its {joiners} new workers are ready ({int(rows[0][2])} so far); training goes on "
                    f"at {self.num_nodes} nodes")
                print(f"distflow: the gang re-forms at {target} nodes {why}" if not problems else
                      f"distflow: cannot re-form the gang at {target} nodes: {why}", flush=True)
            self._said = target
            return None
        return target

    def at_step_boundary(self, worker, saved: bool) -> bool:
        """Collective over the world, after step ``worker.step``: poll, and when the gang re-forms,
        complete this step's checkpoint, announce the next world and set ``worker.reform_to``.
        True: ``train`` returns, and the worker's process calls ``reform``."""
        paused_at = time.monotonic()
        target = self.poll(worker)
        if target is None:
            return False
        global _PAUSED_AT
        _PAUSED_AT = paused_at
        if worker.spec.checkpoint.dir and not saved:
            worker._save_checkpoint()  # complete on every rank once it returns (checkpoint.save agrees)
        self.generation += 1
        world = target * self.procs_per_node
        if worker.rank == 0:
            process_group.announce_world(self.store, self.generation, world if target > self.num_nodes else 0)
        if worker.is_logger:
            note = "" if worker.spec.checkpoint.dir else "; no checkpoint.dir: the new size starts over"
            print(f"distflow: after step {worker.step} the gang re-forms in place at {target} nodes "
                  f"({worker.env.world_size} -> {world} workers){note}", flush=True)
        worker.reform_to = target
        return True


_PAUSED_AT: float | None = None
"""When this process's gang stopped training for its last in-place resize (``time.monotonic``); None: none
since the last ``resumed``."""


def resumed(worker) -> float | None:
    """After the worker built on the re-formed world resumed its checkpoint, before its first step:
    the seconds the gang trained nothing (step boundary -> now: checkpoint, re-form, model build,
    checkpoint load), said by rank 0 and exported (``distflow_resize_pause_seconds``). None in a
    process that did not take part in the re-form (a joiner, a first world)."""
    global _PAUSED_AT
    if _PAUSED_AT is None:
        return None
    pause, _PAUSED_AT = time.monotonic() - _PAUSED_AT, None
    if worker.is_logger:
        print(f"distflow: the gang runs at {worker.env.num_nodes} nodes from step {worker.step + 1}; the resize "
              f"cost {pause:.1f} s without training (checkpoint, re-form, model build, checkpoint load)", flush=True)
    if worker.exporter is not None:
        worker.exporter.observe_resize_pause(pause)
    return pause


def reform(worker) -> tuple[JobSpec, "WorkerEnv"]:  # noqa: F821 (distflow.worker's, not imported: a cycle)
    """After ``train`` returned with ``worker.reform_to`` set: close ``worker`` and join the next world.
    Returns the spec and environment to build the worker again with (``env.formed``); the caller
    drops its reference to ``worker`` first, so that its models are freed before the next are built.

    Raises:
        SystemExit: ``EXIT_LEFT_POOL`` on a rank the new size drops (the operator deletes its pod).
    """
    gang, env, target = worker.gang, worker.env, worker.reform_to
    spec, _ = resized_spec(worker.given, target)  # as given: the next worker settles its device defaults
    device = worker.device
    worker.close()  # every rank of the old world (a barrier), then its groups are gone
    if env.rank >= spec.world_size:
        print(f"distflow: rank {env.rank} leaves the gang after step {worker.step} ({env.world_size} -> "
              f"{spec.world_size} workers)", flush=True)
        raise SystemExit(EXIT_LEFT_POOL)
    process_group.reform(device, gang.store, gang.generation, env.rank, spec.world_size)
    return spec, replace(env, world_size=spec.world_size, num_nodes=target, formed=True, generation=gang.generation)


def join(spec: JobSpec, env, timeout_s: float = 3600.0):
    """A joiner (``env.join``, a job without pools): serve this node's metrics, wait until the running
    ranks form a world that takes this worker, and join it. Returns the environment to build the
    worker with (``env.formed``); the worker then resumes the checkpoint the gang saved. None: the
    job's store closed first (the gang trained its last step before it could grow): the worker
    exits 0, as the gang's ranks did.

    Raises:
        SystemExit: ``EXIT_LEFT_POOL`` when the request no longer asks for the size this pod was started
            for (a resize set back before the gang took it; the operator deletes the pod).
        RuntimeError: no world took this worker within ``timeout_s`` seconds, or one of another size
            (``process_group.wait_to_join``); torch's DistStoreError: no store answered.
    """
    from distflow.engines import fsdp

    if env.local_rank == 0:
        NodeExporter.serving(env.job_name, env.node_rank, env.metrics_port)  # the pod is Ready while it waits
    print(f"distflow: rank {env.rank} waits for the job's store at {env.master_addr}:{env.master_port} to "
          "join the gang", flush=True)
    _warm_up(env.model_dir)
    store = process_group.join_store(env.master_addr, env.master_port)
    def wanted() -> bool:  # the request still asks for the size this pod was started for
        request = read_request(Path(env.resize_file)) if env.resize_file else None
        return request is None or not request.in_place or request.num_nodes == env.num_nodes

    try:
        generation = process_group.wait_to_join(store, env.world_size, env.rank, "the gang", timeout_s, wanted)
    except dist.DistNetworkError as err:  # rank 0's store is gone: its process ended
        print(f"distflow: rank {env.rank}: the job's store closed before a world took this worker ({err}): the "
              "gang finished its last step first (a failed gang is restarted by the operator); nothing to "
              "train here", flush=True)
        return None
    if generation is None:
        print(f"distflow: rank {env.rank} leaves before joining: the resize to {env.num_nodes} nodes it was started "
              "for is no longer asked for", flush=True)
        raise SystemExit(EXIT_LEFT_POOL)
    device = fsdp.select_device(spec.cluster.device, env.device_index).device
    process_group.reform(device, store, generation, env.rank, env.world_size)
    print(f"distflow: rank {env.rank} joined the gang (world {generation}, {env.world_size} workers)", flush=True)
    return replace(env, join=False, formed=True, generation=generation)


def _warm_up(model_dir: str) -> None:
    """What a joiner's worker first loads, loaded while the gang trains rather than while it waits:
    the tokenizer and the model's transformers classes (its parameters on the meta device, free).
    The running workers have them loaded; a joiner's build after the re-form is then as quick as theirs."""
    from distflow.engines.loading import empty_causal_lm
    from distflow.models import load_tokenizer

    load_tokenizer(model_dir)
    empty_causal_lm(model_dir, torch.float32)


def collect() -> None:
    """Free a closed worker's memory before the next is built (its models hold reference cycles)."""
    from distflow.malloc import release_freed_memory

    gc.collect()
    release_freed_memory()
