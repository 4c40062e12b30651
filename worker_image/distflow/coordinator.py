"""The data coordinator: lays a step's samples out for each node of the chain.

    produce(node, batch)            ensure(node)                     exchange
    --------------------   ----------------------------------   -------------------
    batch @ placement A -> same placement? local cache (0 B) -> all_to_all / shm
                           else: all-gather lengths (metadata),  (or, centralized:
                           every rank plans the same moves       gather+scatter via 0)

Each rank holds only its own samples. To change placement every rank
all-gathers the per-sample token counts (a few bytes per sample), computes
its own send row and receive column (``plan_for_rank``) of the same
``RedistributionPlan`` (balanced by token cost for the train layout, back to
the generating rank for the rollout layout) and executes it. When the actor
shares prompt prefixes, the train layout balances whole prompt groups (cost:
the prompt once plus every response), so each group's prompt still runs once. No rank
ever holds the global batch, except rank 0 in ``centralized`` mode, which
routes every edge through itself as a single-controller system does.

Step data lives in a ``StepBuffer``: the swap at a step boundary is O(1)
and the finished step's tensors are freed on a background thread. It lives on
the worker's device: ``produce`` puts a batch there once and every edge keeps
it there (NCCL moves CUDA tensors in place; no host copy per edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distflow.data.balance import imbalance, sample_cost
from distflow.data.batch import PackedBatch
from distflow.data.buffer import NodeBuffer, StepBuffer
from distflow.data.counters import TransferCounters
from distflow.data.centralized import exchange_centralized
from distflow.data.exchange import exchange, gather_metadata
from distflow.data.redistribute import balanced_assignment, plan_digest, plan_for_rank, plan_redistribution
from distflow.planner import ROLLOUT, Plan, PlannedNode, same_samples
from distflow.spec import JobSpec


@dataclass
class DataCoordinator:
    spec: JobSpec
    plan: Plan
    rank: int
    counters: TransferCounters
    node_buffer: NodeBuffer | None = None
    device: torch.device | None = None
    """Where step data lives (the worker's device); None keeps each batch where its producer put it."""
    buffer: StepBuffer = field(default_factory=StepBuffer)
    step: int = 0
    placement: str = ROLLOUT
    producer: str = ""
    last_imbalance: float = 1.0
    metadata_capacity: int = 0
    """Rows each rank pads its metadata to: the fullest rank seen so far (equal on every rank)."""
    last_plan_digest: int = 0
    """``plan_digest`` of the last move's target; the next metadata all-gather checks all ranks agree."""

    @property
    def batch(self) -> PackedBatch:
        """This rank's samples of the step, laid out for the current placement."""
        return self.buffer.get("batch")

    @property
    def centralized(self) -> bool:
        return self.spec.data_plane.mode == "centralized"

    def produce(self, node_id: str, batch: PackedBatch) -> None:
        """Record a node's output (this rank's samples, current placement), on ``device``."""
        if self.device is not None:
            batch = _to_device(batch, self.device)
        if node_id == "rollout" or "origin_rank" not in batch.sample_fields:
            batch = batch.with_fields(sample={
                "origin_rank": torch.full((batch.num_samples,), self.rank, dtype=torch.long, device=batch.device),
                "origin_index": torch.arange(batch.num_samples, dtype=torch.long, device=batch.device),
            })
        self.buffer.put("batch", batch)
        self.producer = node_id

    def ensure(self, node: PlannedNode) -> None:
        """Lay the step's batch out for ``node``'s placement (collective unless local)."""
        if not self.producer:
            return
        edge = f"{self.producer}->{node.id}"
        src = self.plan.layouts[self.placement]
        dst = self.plan.layouts[node.placement]
        if same_samples(src, dst) and not self.centralized:
            self.counters.record_exchange(edge, cache_hit=True)
            self.placement = node.placement
            return
        self._move(node.placement, edge)

    def regroup(self, target: list[list[int]], edge: str) -> None:
        """Move samples within the current placement so rank r holds ``target[r]`` (collective).

        Sample ids number every rank's samples in rank-then-local order. Used
        by nodes that change the sample set mid-step (DAPO dynamic sampling).
        """
        self._move(self.placement, edge, target)

    def _move(self, placement: str, edge: str, target: list[list[int]] | None = None) -> None:
        batch = self.batch
        layout = self.plan.layouts[placement]
        fields = batch.sample_fields
        share = target is None and layout.balanced and self._shares_prompts(batch)
        to_origin = target is None and not layout.balanced and placement == ROLLOUT
        columns = ([fields["group_index"], fields["prompt_len"]] if share
                   else [fields["origin_rank"], fields["origin_index"]] if to_origin else [])
        # ONE all-gather: lengths and schema digests for the exchange, plus what the target needs
        # (prompt groups to balance, or where each sample was generated), plus the last plan's digest.
        metadata = gather_metadata(batch, columns, self.metadata_capacity, plan_digest=self.last_plan_digest)
        self.metadata_capacity = max(self.metadata_capacity, metadata.max_count)
        lengths = metadata.lengths
        holdings, offset = [], 0
        for lens in lengths:
            holdings.append(list(range(offset, offset + lens.numel())))
            offset += lens.numel()
        flat = torch.cat(lengths).tolist() if lengths else []
        source = self.plan.layouts[self.placement]
        cross = target is None and source.first_rank != layout.first_rank  # rollout pool -> trainer pool
        # Across pools, plan as if the rollout ranks were the trainer ranks (their order kept): the
        # same target as sync mode on as many ranks computes from the same samples.
        view = pool_view(holdings, source, layout) if cross else holdings
        if target is None:
            extra = torch.cat(metadata.rows)[:, 1:].tolist() if columns else []
            if share:
                groups = prompt_groups(extra, layout.dp_size)
                target = (self._balance_groups(view, flat, groups, layout.dp_size) if groups is not None
                          else self._balance_samples(view, flat, layout.dp_size))
            elif layout.balanced:
                target = self._balance_samples(view, flat, layout.dp_size)
            elif to_origin:
                target = _back_to_origin(holdings, extra)
            elif cross:
                target = even_split([gid for held in view for gid in held], layout.dp_size)
            else:
                target = holdings
            if cross:
                target = from_pool_view(target, layout, len(holdings))
        self.last_plan_digest = plan_digest(target)
        if self.centralized:
            plan = plan_redistribution(holdings, target)  # the root rebuilds every rank's batch
        else:
            plan = plan_for_rank(holdings, target, self.rank)  # O(B + N): this rank's row and column
        run = exchange_centralized if self.centralized else exchange
        kwargs = dict(metadata=metadata)
        if not self.centralized and self.node_buffer is not None:
            kwargs.update(node_of_rank=[self.plan.node_of_rank(r) for r in range(self.plan.world_size)],
                          node_buffer=self.node_buffer, step=self.step)
        self.buffer.put("batch", run(batch, plan, None, self.counters, edge, **kwargs))
        self.placement = placement

    def _shares_prompts(self, batch: PackedBatch) -> bool:
        """The actor runs each prompt once per group (``actor.sharePromptPrefix``) and the
        batch says which samples share a prompt."""
        fields = batch.sample_fields
        return self.spec.actor.share_prompt_prefix and "group_index" in fields and "prompt_len" in fields

    def _balance_samples(self, holdings, lengths: list[int], dp_size: int) -> list[list[int]]:
        """``balanced_assignment`` of single samples by token cost."""
        costs = [sample_cost(n, self.spec.data_plane.balance_alpha) for n in lengths]
        target = balanced_assignment(holdings, costs, dp_size)
        self.last_imbalance = imbalance(costs, target)
        return target

    def _balance_groups(self, holdings, lengths: list[int], groups, dp_size: int) -> list[list[int]]:
        """``balanced_assignment`` over whole prompt groups, expanded back to sample ids.

        A group's cost is what its shared-prefix forward processes: the prompt
        once plus every response (``sample_cost`` of those tokens); it is held
        where its first sample is. Within a rank, groups keep their order and
        their samples stay adjacent, so micro-batches see whole groups.
        """
        alpha = self.spec.data_plane.balance_alpha
        costs = [sample_cost(prompt_len + sum(lengths[i] - prompt_len for i in ids), alpha)
                 for ids, prompt_len in groups]
        rank_of_id = {gid: rank for rank, held in enumerate(holdings) for gid in held}
        group_holdings: list[list[int]] = [[] for _ in holdings]
        for unit, (ids, _) in enumerate(groups):
            group_holdings[rank_of_id[ids[0]]].append(unit)
        unit_target = balanced_assignment(group_holdings, costs, dp_size)
        self.last_imbalance = imbalance(costs, unit_target)
        return [[gid for unit in units for gid in groups[unit][0]] for units in unit_target]

    def next_step(self, step: int) -> None:
        """Step boundary: O(1) swap; last step's data is freed in the background."""
        self.buffer.swap()
        if self.node_buffer is not None:
            self.node_buffer.cleanup_step(self.step)
        self.step = step
        self.placement = ROLLOUT
        self.producer = ""


def _to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """The same batch with every field on ``device``: each field moved, not the batch's device
    compared, so none is left behind (``Tensor.to`` copies nothing for a field already there)."""
    return PackedBatch(seq_lens=batch.seq_lens,
                       token_fields={k: v.to(device) for k, v in batch.token_fields.items()},
                       sample_fields={k: v.to(device) for k, v in batch.sample_fields.items()})


def prompt_groups(rows: list[list[int]], dp_size: int) -> list[tuple[list[int], int]] | None:
    """The step's prompt groups as units to balance: ([global ids], prompt tokens) each.

    With ``actor.sharePromptPrefix`` a group that stays on one rank runs its
    prompt once (``engines.model_ops``), so it should move as a unit.

    Args:
        rows: [B] ``[group_index, prompt_len]`` per sample, in global id order.
        dp_size: ranks of the balanced layout.
    Returns:
        Groups in order of their first sample, or None (balance single
        samples instead) when the groups differ in size, have one sample
        each, or do not divide evenly over ``dp_size`` ranks: equal sample
        counts per rank come first, as every rank must run the same number
        of micro-batches.
    """
    members: dict[int, list[int]] = {}
    prompt: dict[int, int] = {}
    for gid, (group, prompt_len) in enumerate(rows):
        members.setdefault(group, []).append(gid)
        prompt[group] = prompt_len
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1 or sizes == {1} or len(members) % dp_size:
        return None
    return [(m, prompt[g]) for g, m in sorted(members.items(), key=lambda kv: kv[1][0])]


def pool_view(holdings: list[list[int]], source, dest) -> list[list[int]]:
    """The source pool's holdings as if its ranks were ``dest``'s: ``source``'s ranks in order,
    padded with empty ranks to at least ``dest.num_ranks``.

    Args:
        holdings: [W] global sample ids each world rank holds.
        source, dest: ``planner.Layout`` of the two pools.
    """
    view = [list(h) for h in holdings[source.first_rank: source.first_rank + source.num_ranks]]
    return view + [[] for _ in range(dest.num_ranks - len(view))]


def from_pool_view(target: list[list[int]], dest, world_size: int) -> list[list[int]]:
    """A target over ``dest``'s ranks (its first ``dest.num_ranks`` entries) as a target over the
    world: rank ``dest.first_rank + r`` gets ``target[r]``, every other rank nothing.

    Raises:
        ValueError: the target gives samples to a rank beyond ``dest``'s.
    """
    if any(target[dest.num_ranks:]):
        raise ValueError(f"the target gives samples to ranks beyond the {dest.num_ranks} of pool {dest.name}")
    out: list[list[int]] = [[] for _ in range(world_size)]
    for r in range(dest.num_ranks):
        out[dest.first_rank + r] = list(target[r])
    return out


def even_split(ids: list[int], num_ranks: int) -> list[list[int]]:
    """``ids`` in order, cut into ``num_ranks`` contiguous parts whose sizes differ by at most one."""
    base, extra = divmod(len(ids), num_ranks)
    out, start = [], 0
    for r in range(num_ranks):
        size = base + (r < extra)
        out.append(ids[start: start + size])
        start += size
    return out


def _back_to_origin(holdings: list[list[int]], origins: list[list[int]]) -> list[list[int]]:
    """Every sample back to the rank that generated it, in generation order.

    Args:
        holdings: global sample ids each rank holds now.
        origins: [B] ``[origin_rank, origin_index]`` per sample, in global id order.
    """
    ids = [gid for held in holdings for gid in held]
    target: list[list[int]] = [[] for _ in holdings]
    for (rank, _), gid in sorted(zip(map(tuple, origins), ids)):
        target[rank].append(gid)
    return target
