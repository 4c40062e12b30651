"""DAPO dynamic sampling (Yu et al. 2025): keep prompt groups with signal, refill, regroup evenly.

    rollout -> reward -> filter_groups -+-> round 2..k: generate + score (this stage)
                                        +-> select N groups globally, regroup evenly
                                        -> reward_shaping -> advantage -> actor

The stage replaces the step's samples: every rank runs the same number of
rounds (the decision is on a global count), computes the same selection
(``plan_group_selection``) from all-gathered candidate metadata, and ends
with trainBatchSize / dp groups.

Simplified on purpose: refill rounds are scored with ``data.rewardFn`` (what
the reward node uses), so a workflow whose custom node rewrites scores must
run it after dynamic sampling.
"""

from __future__ import annotations

import torch

from distflow.algorithms import groups_with_signal, plan_group_selection
from distflow.data.batch import PackedBatch
from distflow.data.exchange import allgather_lengths
from distflow.engines.rollout import step_seed
from distflow.planner import PlannedNode
from distflow.stages.context import StageContext, StageOutput
from distflow.stages.rollout import generate_round, sampling_params
from distflow.stages.scoring import score_fields, score_responses

# What rollout + reward produce: the only fields a refill round can reproduce.
_ROUND_TOKEN_FIELDS = frozenset({"input_ids", "response_mask", "token_level_scores"})
_ROUND_SAMPLE_FIELDS = frozenset({"prompt_len", "response_len", "group_index", "scores"})
_ORIGIN_FIELDS = ("origin_rank", "origin_index")


def run_filter_groups(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    """Keep groups with signal, refill from more rounds, regroup evenly; returns the new samples.

    Raises:
        ValueError: the batch has fields a refill round cannot produce (a node
            that adds them must depend on this one).
    """
    spec, cfg = ctx.spec, ctx.spec.algorithm.filter_groups
    pool = _CandidatePool(spec.rollout.n)
    num_groups, num_kept = pool.add(_round_batch(batch, node), 0)
    total_kept = _global_count(ctx, num_kept)
    rounds = 1
    while total_kept < spec.data.train_batch_size and rounds < cfg.max_num_gen_batches:
        generated, kept = pool.add(_refill_round(ctx, rounds), rounds)
        num_groups, num_kept, rounds = num_groups + generated, num_kept + kept, rounds + 1
        total_kept = _global_count(ctx, num_kept)
    selected, padded = _select_and_regroup(ctx, node, pool)
    ctx.metrics.add_max("dapo/num_gen_batches", rounds)
    ctx.metrics.add_sum("dapo/kept_groups", num_kept)
    ctx.metrics.add_sum("dapo/dropped_groups", num_groups - num_kept)
    ctx.metrics.add_max("dapo/padded_groups", padded)
    return StageOutput(batch=selected)


class _CandidatePool:
    """This rank's candidate groups in local order: batches of whole groups plus (has_signal, round) per group."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.parts: list[PackedBatch] = []
        self.meta: list[tuple[bool, int]] = []

    def add(self, batch: PackedBatch, rnd: int) -> tuple[int, int]:
        """Add a scored round; returns (groups in it, groups with signal).

        Groups without signal are kept from round 0 only: round 0 alone has
        trainBatchSize groups, so padding never needs later ones.
        """
        n = self.group_size
        assert batch.num_samples % n == 0, "rollout groups have rollout.n adjacent samples"
        signal = groups_with_signal(batch.sample_fields["scores"], batch.sample_fields["group_index"])
        for flag in ((True, False) if rnd == 0 else (True,)):
            rows = torch.nonzero(signal == flag).flatten().tolist()
            if rows:
                self.parts.append(batch.select(rows))
                self.meta += [(flag, rnd)] * (len(rows) // n)
        return batch.num_samples // n, int(signal.sum()) // n


def _global_count(ctx: StageContext, count: int) -> int:
    return int(ctx.reduce(torch.tensor([float(count)], dtype=torch.float64, device=ctx.device))[0])


def _without_origin(batch: PackedBatch) -> PackedBatch:
    sample = {k: v for k, v in batch.sample_fields.items() if k not in _ORIGIN_FIELDS}
    return PackedBatch(seq_lens=batch.seq_lens, token_fields=batch.token_fields, sample_fields=sample)


def _round_batch(batch: PackedBatch, node: PlannedNode) -> PackedBatch:
    extra = (set(batch.token_fields) - _ROUND_TOKEN_FIELDS) | (
        set(batch.sample_fields) - _ROUND_SAMPLE_FIELDS - set(_ORIGIN_FIELDS))
    if extra:
        raise ValueError(f"workflow node {node.id}: the batch already has fields {sorted(extra)} that refill "
                         f"rounds cannot produce; make the nodes that add them depend on {node.id}")
    return _without_origin(batch)


def _refill_round(ctx: StageContext, rnd: int) -> PackedBatch:
    """Refill round ``rnd`` >= 1: the loader's next prompts, generated and scored like rollout + reward.

    Group ids must not collide with round 0's (step * B + i): round k of step s
    numbers its prompts as step s + k * totalSteps would, unique within the run.
    """
    spec = ctx.spec
    records = ctx.loader.next_batch()
    base = (ctx.step + rnd * spec.trainer.total_steps) * spec.data.train_batch_size
    group_index = [base + ctx.rollout_dp_rank * len(records) + i for i in range(len(records))]
    batch = generate_round(ctx.models.rollout, ctx.tokenizer, spec, records, group_index, sampling_params(spec),
                           step_seed(spec.trainer.seed, ctx.step, rnd), ctx.metrics)
    _, _, scores = score_responses(ctx.tokenizer, batch, dict(zip(group_index, records)), spec.data.reward_fn,
                                   f"at step {ctx.step + 1}")
    out = score_fields(batch, scores)
    return batch.with_fields(token=out.token, sample=out.sample)


def _select_and_regroup(ctx: StageContext, node: PlannedNode, pool: _CandidatePool) -> tuple[PackedBatch, int]:
    """Keep the planned groups and move them so every rank holds its quota.

    Group ids are numbered rank-then-local over all ranks' candidates; only
    one int per candidate group is all-gathered.

    Returns:
        (this rank's groups after the move, groups padded in without signal, over all ranks).
    """
    n, rank = pool.group_size, ctx.rank
    codes = torch.tensor([2 * rnd + int(signal) for signal, rnd in pool.meta], dtype=torch.int64, device="cpu")
    candidates = [[(bool(c % 2), c // 2) for c in part.tolist()] for part in allgather_lengths(codes)]
    target = plan_group_selection(candidates, ctx.spec.data.train_batch_size)
    first = sum(len(c) for c in candidates[:rank])
    chosen = sorted(g for held in target for g in held)
    mine = [g - first for g in chosen if first <= g < first + len(candidates[rank])]
    local = PackedBatch.concat(pool.parts).select([p * n + j for p in mine for j in range(n)])
    # Kept groups renumbered rank-then-local: the sample ids the coordinator's plan uses.
    position = {g: i for i, g in enumerate(chosen)}
    moved = ctx.regroup(node.id, local, [[position[g] * n + j for g in held for j in range(n)] for held in target],
                        f"{node.id}/regroup")
    flat = [c for part in candidates for c in part]
    return _without_origin(moved), sum(not flat[g][0] for g in chosen)
