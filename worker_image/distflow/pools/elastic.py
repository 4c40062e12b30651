"""In-place resize of the rollout pool: the trainer pool keeps training, in the same processes.

    step boundary (every rank of world g, after the checkpoint and the whole-gang resize poll)
      each rank reads the request file --all_gather [seen, numNodes, rolloutNodes]--> agree_on_resize
      (a pure function of the gathered reads: every rank computes the same target)
      no in-place request, or the running sizes: go on
      shrink to R' rollout nodes (world W -> W' = W - (R - R') x procsPerNode):
        ranks >= W'  leave: destroy their groups, exit with EXIT_LEFT_POOL (the operator deletes their pods)
        ranks <  W'  re-form: world g+1 met on the job's store (rank 0's TCPStore, a key prefix per
                     world), every group of the pooled worker again, the trainer pool's FSDP mesh
                     rebound to the new groups (model, Adam state, RNG stay in memory: no checkpoint),
                     the prompt stream resharded over the new rollout dp size at its position, the
                     data coordinator on the new plan; the steps in flight (crossed to the trainers,
                     not trained yet) stay where they are

The ranks are laid out trainers first (``0 .. T-1``), then the rollout nodes
in order, so a shrink drops the highest ranks and no survivor changes rank:
the trainer pool's mesh keeps its ranks and each trainer its local shards.

Deliberately simplified: only the shrink is done in place. A request to grow
the rollout pool is left alone here (the workers go on at their size, and say
so once); it needs joiner processes that meet the running ranks on the job's
store, which ``process_group.join_store`` starts (see the module's
``GROW_PROTOCOL``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from distflow import process_group
from distflow.data.counters import TransferCounters
from distflow.engines import fsdp
from distflow.planner import build_plan
from distflow.resize import ResizeRequest, read_request
from distflow.spec import JobSpec

GROW_PROTOCOL = """\
not done yet: joiners started with DISTFLOW_JOIN_WORLD=<generation>:<world size> would set
<prefix>/ready/<rank> in the job's store once their replica is loaded; the running ranks would
check the count at each boundary (agree_on_resize's target, once every joiner is ready) and re-form
world <generation> with them; the joiners then take the step, the loader state and the policy
(a weight sync) from the trainer pool."""


@dataclass(frozen=True)
class PoolSize:
    """The gang's nodes and how many of them generate (cluster.numNodes, async.rolloutPool.numNodes)."""

    num_nodes: int
    rollout_nodes: int


def agree_on_resize(reads: Sequence[ResizeRequest | None], current: PoolSize, procs_per_node: int,
                    train_batch_size: int) -> PoolSize | None:
    """The rollout pool's next size, from every rank's read of the request (pure: every rank
    computes it from the same all-gathered reads).

    A ConfigMap update reaches the nodes at different moments, so ranks may read an older
    request, or none: the lowest rank's read that asks for an in-place resize to another size
    wins. A size the rollout pool cannot take (``train_batch_size`` prompts not divisible
    over its ``rollout_nodes x procs_per_node`` dp ranks) is no request.

    Args:
        reads: each rank's request, in rank order (None: no readable request).
        current: the running sizes.
        procs_per_node: workers per node (cluster.procsPerNode).
        train_batch_size: prompts per step (data.trainBatchSize).

    Returns:
        The new sizes, or None: go on at ``current``.
    """
    for request in reads:
        if request is None or not request.in_place_for(current.num_nodes, current.rollout_nodes):
            continue
        target = PoolSize(request.num_nodes, request.rollout_nodes)
        if target != current and train_batch_size % (target.rollout_nodes * procs_per_node) == 0:
            return target
    return None


def resized_spec(spec: JobSpec, size: PoolSize) -> JobSpec:
    """``spec`` with cluster.numNodes and async.rolloutPool.numNodes of ``size`` (the rest as it is)."""
    pools = spec.async_.model_copy(update={
        "rollout_pool": spec.async_.rollout_pool.model_copy(update={"num_nodes": size.rollout_nodes})})
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"num_nodes": size.num_nodes}),
                                   "async_": pools})


def _encode(request: ResizeRequest | None) -> list[int]:
    if request is None or request.rollout_nodes is None:
        return [0, 0, 0]
    return [1, request.num_nodes, request.rollout_nodes]


def _decode(row: list[int]) -> ResizeRequest | None:
    return ResizeRequest(row[1], row[2]) if row[0] else None


class RolloutPoolResize:
    """Polled by every rank of a pooled job at each step boundary: resize the rollout pool in place.

    Args:
        path: the mounted request file (``<spec dir>/resize``, ``distflow.resize``).
        current: the running sizes.
        procs_per_node: workers per node.
        train_batch_size: prompts per step.
        store: the job's store (``process_group.world_store``), which outlives each world.
    """

    def __init__(self, path: Path | str, current: PoolSize, procs_per_node: int, train_batch_size: int, store):
        self.path, self.current, self.store = Path(path), current, store
        self.procs_per_node, self.train_batch_size = procs_per_node, train_batch_size
        self.generation = 0
        """Worlds formed so far after the first (each meets under its own key prefix)."""
        self._said_grow = False

    @classmethod
    def for_worker(cls, worker) -> "RolloutPoolResize":
        """The poll of a ``PoolWorker`` (its spec and the world's store)."""
        spec = worker.spec
        return cls(worker.env.resize_file, PoolSize(spec.cluster.num_nodes, spec.async_.rollout_pool.num_nodes),
                   spec.cluster.procs_per_node, spec.data.train_batch_size, process_group.world_store())

    def poll(self) -> PoolSize | None:
        """The agreed next size (collective over the world: one all-gather of 3 integers per rank)."""
        mine = torch.tensor(_encode(read_request(self.path)), dtype=torch.int64)
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        return agree_on_resize([_decode(r.tolist()) for r in rows], self.current, self.procs_per_node,
                               self.train_batch_size)

    def at_step_boundary(self, worker) -> bool:
        """Collective over the world, at a step boundary: poll, and resize when agreed. True when this
        rank left the pool (``worker.left_pool``; it has no group any more and must exit)."""
        target = self.poll()
        if target is None:
            return False
        if target.rollout_nodes > self.current.rollout_nodes:
            if worker.is_logger and not self._said_grow:
                print(f"distflow: growing the rollout pool in place to {target.rollout_nodes} nodes is not "
                      "supported yet; the job goes on at its size", flush=True)
            self._said_grow = True
            return False
        old_world = worker.env.world_size
        self.current, self.generation = target, self.generation + 1
        spec = resized_spec(worker.spec, target)
        if worker.rank >= spec.world_size:
            process_group.leave()
            worker.left_pool = True
            print(f"distflow: rank {worker.rank} leaves the rollout pool after step {worker.step} "
                  f"({old_world} -> {spec.world_size} workers)", flush=True)
            return True
        process_group.reform(worker.device, self.store, self.generation, worker.rank, spec.world_size)
        regroup(worker, spec)
        if worker.is_logger:
            print(f"distflow: the rollout pool is {target.rollout_nodes} nodes from step {worker.step + 1} "
                  f"({old_world} -> {spec.world_size} workers, re-formed in place)", flush=True)
        return False


def regroup(worker, spec: JobSpec) -> None:
    """A pooled worker's state on the new world (``process_group.reform`` done): its plan, every
    group, the trainer pool's FSDP mesh rebound (``fsdp.rebind_mesh``), its prompt stream and its
    data coordinator. Collective over the new world (the groups)."""
    old_mesh = worker.mesh
    worker.spec, worker.plan = spec, build_plan(spec)
    worker.env = replace(worker.env, world_size=spec.world_size, num_nodes=spec.cluster.num_nodes)
    worker._build_groups()
    if worker.trains:
        critic = worker.critic.model if worker.critic is not None else None
        fsdp.rebind_mesh(old_mesh, worker.mesh, [worker.actor_model, worker.ref_model, critic])
        worker.mesh = old_mesh  # the models' mesh, served by the new world's groups
    worker.rollout_dp_rank = 0 if worker.trains else worker.rollout_layout.dp_rank(worker.rank)
    worker.loader.reshard(worker.rollout_dp_rank, worker.rollout_layout.dp_size)
    worker.counters = TransferCounters(node_of_rank=[worker.plan.node_of_rank(r) for r in range(spec.world_size)])
    # The step buffer (the steps in flight) is kept; the metadata padding and the last plan's
    # digest start over on every rank alike.
    worker.coordinator = replace(worker.coordinator, spec=spec, plan=worker.plan, counters=worker.counters,
                                 metadata_capacity=0, last_plan_digest=0)
    if worker.resize_watch is not None:
        worker.resize_watch.num_nodes = spec.cluster.num_nodes
        worker.resize_watch.rollout_nodes = spec.async_.rollout_pool.num_nodes
