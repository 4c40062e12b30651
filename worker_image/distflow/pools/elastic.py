"""In-place resize of the rollout pool: the trainer pool keeps training, in the same processes.

    step boundary (every rank of world g, after the checkpoint and the whole-gang resize poll)
      each rank reads the request file --all_gather [seen, numNodes, rolloutNodes, ready]--> agree_on_resize
      (a pure function of the gathered reads: every rank computes the same target; ready is rank 0's
      count of the joiners registered in the job's store)
      no in-place request, or the running sizes: go on
      shrink to R' rollout nodes (world W -> W' = W - (R - R') x procsPerNode):
        ranks >= W'  leave: destroy their groups, exit with EXIT_LEFT_POOL (the operator deletes their pods)
        ranks <  W'  re-form (below)
      grow to R' (W' > W): once every joiner is ready (until then: go on at W, and poll again next step)
        all ranks    re-form (below), joiners included; then the first rollout rank hands the joiners
                     the step and the prompt stream's position, and a weight sync gives them the policy
      re-form: world g+1 met on the job's store (rank 0's TCPStore, a key prefix per world), every
               group of the pooled worker again, the trainer pool's FSDP mesh rebound to the new
               groups (model, Adam state, RNG stay in memory: no checkpoint), the prompt stream
               resharded over the new rollout dp size at its position, the data coordinator on the
               new plan; the steps in flight (crossed to the trainers, not trained yet) stay where
               they are

    joiner (a pod started with DISTFLOW_JOIN=1, PET_NNODES and its spec at the new size)
      loads its replica and its prompt stream alone (no world yet), adds 1 to distflow/world<g+1>/ready,
      waits for distflow/world<g+1>/go, joins world g+1, takes the hand-over, and runs the schedule on

The ranks are laid out trainers first (``0 .. T-1``), then the rollout nodes in
order, so a shrink drops the highest ranks and a grow appends ranks: no running
rank changes rank, and the trainer pool's mesh keeps its ranks and each trainer
its local shards.

Deliberately simplified: the trainer nodes never change here (that is a
whole-gang resize, ``distflow.resize``); a joiner that is not ready is waited
for at each boundary, without a deadline on the running side (the operator
deletes a pod that never starts; the job goes on at its size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from distflow import precision, process_group
from distflow.data.counters import TransferCounters
from distflow.engines import fsdp
from distflow.planner import build_plan
from distflow.resize import ResizeRequest, read_request
from distflow.spec import JobSpec


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

    Store keys (on the job's store, which every world of the job meets on):
    ``distflow/generation`` the current world's generation (0: the first); joiners add 1 to
    ``distflow/world<g>/ready`` (g: the world they wait for, generation + 1) and wait for
    ``distflow/world<g>/go``: that world's size when it takes them, ``0`` when world g formed
    without them (a shrink came first): they register again for the next.

    Args:
        path: the mounted request file (``<spec dir>/resize``, ``distflow.resize``).
        current: the running sizes (a joiner: the sizes it grows the pool to).
        procs_per_node: workers per node.
        train_batch_size: prompts per step.
        store: the job's store (``process_group.world_store``, or a joiner's ``join_store``).
        joining: this process is a joiner (``WorkerEnv.join``) that has not joined yet.
    """

    def __init__(self, path: Path | str, current: PoolSize, procs_per_node: int, train_batch_size: int, store,
                 joining: bool = False):
        self.path, self.current, self.store = Path(path), current, store
        self.procs_per_node, self.train_batch_size = procs_per_node, train_batch_size
        self.joining = joining
        self.generation = 0
        """Worlds formed so far after the first (each meets under its own key prefix)."""
        self._waiting_for: PoolSize | None = None

    @classmethod
    def for_worker(cls, worker) -> "RolloutPoolResize":
        """The poll of a ``PoolWorker`` (its spec and the job's store); rank 0 publishes generation 0."""
        spec, env = worker.spec, worker.env
        if env.join:
            print(f"distflow: rank {env.rank} is loaded; it waits for the job's store at "
                  f"{env.master_addr}:{env.master_port} to join the rollout pool", flush=True)
        store = process_group.join_store(env.master_addr, env.master_port) if env.join \
            else process_group.world_store()
        if env.rank == 0:
            store.set(process_group.GENERATION_KEY, "0")
        return cls(env.resize_file, PoolSize(spec.cluster.num_nodes, spec.async_.rollout_pool.num_nodes),
                   spec.cluster.procs_per_node, spec.data.train_batch_size, store, joining=env.join)

    def poll(self) -> tuple[PoolSize | None, int]:
        """(the agreed next size or None, the joiners ready for the next world as rank 0 counts them).
        Collective over the world: one all-gather of 4 integers per rank."""
        ready = int(self.store.add(process_group.world_key(self.generation + 1, "ready"), 0)) if dist.get_rank() == 0 else 0
        mine = torch.tensor([*_encode(read_request(self.path)), ready], dtype=torch.int64)
        rows = [torch.zeros(4, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        target = agree_on_resize([_decode(r.tolist()) for r in rows], self.current, self.procs_per_node,
                                 self.train_batch_size)
        return target, int(rows[0][3])

    def at_step_boundary(self, worker) -> bool:
        """Collective over the world, at a step boundary: poll, and resize when agreed (a grow once
        every joiner is ready). True when this rank left the pool (``worker.left_pool``; it has no
        group any more and must exit)."""
        if worker.step >= worker.spec.trainer.total_steps:
            return False  # the last boundary: nothing is left to resize for (every rank knows it)
        target, ready = self.poll()
        if target is None:
            return False
        spec, old_world = resized_spec(worker.spec, target), worker.env.world_size
        joiners = spec.world_size - old_world
        if joiners > 0 and ready < joiners:
            if worker.is_logger and self._waiting_for != target:
                print(f"distflow: the rollout pool grows to {target.rollout_nodes} nodes once its {joiners} new "
                      f"workers are ready ({ready} so far); training goes on at {old_world} workers", flush=True)
            self._waiting_for = target
            return False
        self.current, self.generation = target, self.generation + 1
        if worker.rank == 0:
            process_group.announce_world(self.store, self.generation, spec.world_size if joiners > 0 else 0)
        if worker.rank >= spec.world_size:
            process_group.leave()
            worker.left_pool = True
            print(f"distflow: rank {worker.rank} leaves the rollout pool after step {worker.step} "
                  f"({old_world} -> {spec.world_size} workers)", flush=True)
            return True
        process_group.reform(worker.device, self.store, self.generation, worker.rank, spec.world_size)
        regroup(worker, spec)
        if joiners > 0:
            hand_over(worker)
        if worker.is_logger:
            print(f"distflow: after step {worker.step} the rollout pool is {target.rollout_nodes} nodes; it "
                  f"generates step {_next_generated(worker)} on ({old_world} -> {spec.world_size} workers, "
                  "re-formed in place)", flush=True)
        return False

    def join(self, worker, timeout_s: float = 3600.0) -> int:
        """A joiner: register as ready, wait until the running ranks form the world that takes it,
        join it, and take the step, the prompt stream's position and the policy from them.
        Collective over the new world once the running ranks form it. Returns the steps trained.

        Raises:
            RuntimeError: no world took this worker within ``timeout_s`` seconds, or one of
                another size did (the request and this pod's PET_NNODES disagree).
        """
        generation = process_group.wait_to_join(self.store, worker.env.world_size, worker.rank,
                                                "the rollout pool", timeout_s)
        self.joining, self.generation = False, generation
        process_group.reform(worker.device, self.store, generation, worker.rank, worker.env.world_size)
        worker._build_groups()
        hand_over(worker)
        print(f"distflow: rank {worker.rank} joined the rollout pool after step {worker.step}; it generates "
              f"step {_next_generated(worker)} on (policy version {worker.version})", flush=True)
        return worker.step


def _next_generated(worker) -> int:
    """The first step (from 1) the rollout pool generates after a boundary: the steps up to
    ``maxStaleness`` past the trained ones are generated already (in flight)."""
    return worker.step + worker.plan.staleness + 1


def hand_over(worker) -> None:
    """After a grow, on every rank of the new world (collective): the first rollout rank (a running
    one) gives the joiners the steps trained and the prompt stream's position; then the trainer
    pool syncs the policy into every rollout replica (the joiners' first weights)."""
    state = [{"step": worker.step, "loader": worker.loader.state_dict(), "compute_dtype": worker.spec.model.compute_dtype}]
    dist.broadcast_object_list(state, src=worker.rollout_layout.first_rank)
    precision.check_joiner(worker.spec.model.compute_dtype, state[0]["compute_dtype"], worker.rank)
    if not worker.trains:
        worker.step = state[0]["step"]
        worker.loader.load_state_dict(state[0]["loader"])
    worker._sync_weights()


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
    worker.counters = TransferCounters.for_plan(worker.plan, spec.world_size)
    # The step buffer (the steps in flight) is kept; the metadata padding and the last plan's
    # digest start over on every rank alike.
    worker.coordinator = replace(worker.coordinator, spec=spec, plan=worker.plan, counters=worker.counters,
                                 metadata_capacity=0, last_plan_digest=0)
    if worker.resize_watch is not None:
        worker.resize_watch.num_nodes = spec.cluster.num_nodes
        worker.resize_watch.rollout_nodes = spec.async_.rollout_pool.num_nodes
