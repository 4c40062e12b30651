"""Stages of the PPO and DAPO nodes: values, critic update, reward shaping, dynamic sampling.

Same contract as ``distflow.stages`` (``stage(worker, node) -> None`` on the
step's local batch, already laid out for the node's placement); registered
into ``stages.STAGES`` by role. Fields added:

    values          values [T_total] (critic, rollout time; the clip centre of the critic update)
    critic (train)  updates the critic on ``returns``; critic/vf_explained_var_rollout scores the
                    rollout-time values (out of sample), critic/vf_explained_var the update's predictions
    reward_shaping  token_level_rewards [T_total] = scores + overlong penalty - beta * KL
    filter_groups   replaces the batch: groups whose scores differ, refilled by more rounds

    ppo:   rollout -> reward -> values -> [reward_shaping] -> advantage (gae) -> critic -> actor
    dapo:  rollout -> reward -> filter_groups -+-> round 2..k: generate + score (this stage)
                                               +-> select N groups globally, regroup evenly
                                               -> reward_shaping -> advantage -> actor

Simplified on purpose: refill rounds are scored with ``data.rewardFn`` (what
the reward node uses), so a workflow whose custom node rewrites scores must
run it after dynamic sampling.
"""

from __future__ import annotations

import torch

from distflow.algorithms import (
    AdaptiveKLController, FixedKLController, apply_kl_penalty, explained_variance, groups_with_signal,
    overlong_penalty, plan_group_selection,
)
from distflow.data.batch import PackedBatch
from distflow.data.exchange import allgather_lengths
from distflow.engines import model_ops
from distflow.engines.rollout import SamplingParams, render_prompts, response_texts, step_seed
from distflow.planner import PlannedNode
from distflow.rewards import compute_scores
from distflow.spec import KLControlSpec

# What rollout + reward produce: the only fields a refill round can reproduce.
_ROUND_TOKEN_FIELDS = frozenset({"input_ids", "response_mask", "token_level_scores"})
_ROUND_SAMPLE_FIELDS = frozenset({"prompt_len", "response_len", "group_index", "scores"})
_ORIGIN_FIELDS = ("origin_rank", "origin_index")


def build_kl_controller(ctrl: KLControlSpec) -> FixedKLController | AdaptiveKLController:
    """The in-reward KL coefficient of ``algorithm.klCtrl``."""
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)


def run_values(worker, node: PlannedNode) -> None:
    batch = worker.coordinator.batch
    worker.coordinator.produce(node.id, batch.with_fields(token={"values": worker.critic.compute_values(batch)}))


def run_critic_update(worker, node: PlannedNode) -> None:
    """Train the critic; also score its rollout-time values against the returns they never saw."""
    batch = worker.coordinator.batch
    mask = batch.token_fields["response_mask"].double()
    values, returns = batch.token_fields["values"].double(), batch.token_fields["returns"].double()
    worker.metrics.add_mean("critic/values/mean", (values * mask).sum(), mask.sum())
    worker.metrics.add_mean("critic/returns/mean", (returns * mask).sum(), mask.sum())
    ev = explained_variance(values[None], returns[None], mask[None], worker.global_sum)
    if torch.isfinite(ev):  # NaN (equal returns) is NaN on every rank: the metric keys stay aligned
        worker.metrics.add_mean("critic/vf_explained_var_rollout", float(ev), 1.0)
    worker.critic.update(batch, worker.metrics)


def run_reward_shaping(worker, node: PlannedNode) -> None:
    """token_level_rewards from token_level_scores: DAPO's overlong penalty, then the KL penalty."""
    spec, alg = worker.spec, worker.spec.algorithm
    batch = worker.coordinator.batch
    mb = model_ops.collate(batch, worker.tokenizer.pad_token_id)
    rewards = model_ops.window_field(mb, "token_level_scores").float()
    if alg.overlong_buffer.enable:
        buffer = alg.overlong_buffer.length or max(1, spec.data.max_response_length // 4)
        penalty = overlong_penalty(batch.sample_fields["response_len"], spec.data.max_response_length,
                                   buffer, alg.overlong_buffer.penalty_factor)
        rewards[:, -1] += penalty  # every response ends in the window's last column, with its outcome
        worker.metrics.add_mean("reward/overlong_penalty/mean", penalty.double().sum(), penalty.numel())
        worker.metrics.add_mean("reward/overlong_frac", (penalty < 0).double().sum(), penalty.numel())
    if alg.use_kl_in_reward:
        rewards = _kl_in_reward(worker, mb, rewards)
    worker.metrics.add_mean("critic/rewards/mean", (rewards * mb.response_mask).double().sum(), batch.num_samples)
    shaped = model_ops.unwindow(mb, rewards)
    worker.coordinator.produce(node.id, batch.with_fields(token={"token_level_rewards": shaped}))


def _kl_in_reward(worker, mb: model_ops.MicroBatch, rewards: torch.Tensor) -> torch.Tensor:
    """rewards - beta * KL(actor || reference) per token; steps the (adaptive) coefficient on the global KL."""
    alg = worker.spec.algorithm
    beta = worker.kl_ctrl.value
    rewards, mean_kl = apply_kl_penalty(rewards, model_ops.window_field(mb, "old_log_probs"),
                                        model_ops.window_field(mb, "ref_log_probs"), mb.response_mask,
                                        beta, alg.kl_penalty)
    num = mb.response_mask.shape[0]
    sums = worker.global_sum(torch.tensor([float(mean_kl) * num, float(num)], dtype=torch.float64))
    global_kl = float(sums[0] / sums[1].clamp_min(1.0))
    worker.kl_ctrl.update(global_kl, int(sums[1]))
    worker.metrics.add_mean("actor/reward_kl_penalty", global_kl, 1.0)
    worker.metrics.add_mean("actor/reward_kl_penalty_coeff", beta, 1.0)
    return rewards


def run_filter_groups(worker, node: PlannedNode) -> None:
    """DAPO dynamic sampling: keep groups with signal, refill from more rounds, regroup evenly.

    Every rank runs the same number of rounds (the decision is on a global
    count), computes the same selection (``plan_group_selection``) from
    all-gathered candidate metadata, and ends with trainBatchSize / dp groups.

    Raises:
        ValueError: the batch has fields a refill round cannot produce (a node
            that adds them must depend on this one).
    """
    spec, cfg = worker.spec, worker.spec.algorithm.filter_groups
    pool = _CandidatePool(spec.rollout.n)
    num_groups, num_kept = pool.add(_round_batch(worker.coordinator.batch, node), 0)
    total_kept = _global_count(worker, num_kept)
    rounds = 1
    while total_kept < spec.data.train_batch_size and rounds < cfg.max_num_gen_batches:
        generated, kept = pool.add(_generate_round(worker, rounds), rounds)
        num_groups, num_kept, rounds = num_groups + generated, num_kept + kept, rounds + 1
        total_kept = _global_count(worker, num_kept)
    padded = _select_and_regroup(worker, node, pool)
    worker.metrics.add_max("dapo/num_gen_batches", rounds)
    worker.metrics.add_sum("dapo/kept_groups", num_kept)
    worker.metrics.add_sum("dapo/dropped_groups", num_groups - num_kept)
    worker.metrics.add_max("dapo/padded_groups", padded)


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


def _global_count(worker, count: int) -> int:
    return int(worker.global_sum(torch.tensor([float(count)], dtype=torch.float64))[0])


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


def _generate_round(worker, rnd: int) -> PackedBatch:
    """Refill round ``rnd`` >= 1: the loader's next prompts, generated and scored like rollout + reward.

    Group ids must not collide with round 0's (step * B + i): round k of step s
    numbers its prompts as step s + k * totalSteps would, unique within the run.
    """
    spec = worker.spec
    records = worker.loader.next_batch()
    base = (worker.step + rnd * spec.trainer.total_steps) * spec.data.train_batch_size
    group_index = [base + worker.rollout_dp_rank * len(records) + i for i in range(len(records))]
    prompts = render_prompts(worker.tokenizer, records, spec.data.max_prompt_length, spec.data.system_prompt)
    params = SamplingParams(spec.rollout.n, spec.rollout.temperature, spec.rollout.top_p, spec.rollout.top_k,
                            spec.data.max_response_length, spec.rollout.micro_batch_size,
                            share_prefill=spec.rollout.share_prefill)
    batch = worker.rollout.generate(prompts, group_index, params, step_seed(spec.trainer.seed, worker.step, rnd),
                                    worker.metrics)
    record_of = dict(zip(group_index, records))
    texts = response_texts(worker.tokenizer, batch)
    groups = batch.sample_fields["group_index"].tolist()
    scores = torch.tensor(compute_scores(texts, [record_of[g] for g in groups], spec.data.reward_fn),
                          dtype=torch.float32)
    token_scores = torch.zeros(batch.num_tokens, dtype=torch.float32)
    token_scores[batch.cu_seqlens(dtype=torch.long)[1:] - 1] = scores  # the outcome on the last token
    return batch.with_fields(token={"token_level_scores": token_scores}, sample={"scores": scores})


def _select_and_regroup(worker, node: PlannedNode, pool: _CandidatePool) -> int:
    """Keep the planned groups and move them so every rank holds its quota; returns the padded groups.

    Group ids are numbered rank-then-local over all ranks' candidates; only
    one int per candidate group is all-gathered.
    """
    n, rank = pool.group_size, worker.rank
    codes = torch.tensor([2 * rnd + int(signal) for signal, rnd in pool.meta], dtype=torch.int64)
    candidates = [[(bool(c % 2), c // 2) for c in part.tolist()] for part in allgather_lengths(codes)]
    target = plan_group_selection(candidates, worker.spec.data.train_batch_size)
    first = sum(len(c) for c in candidates[:rank])
    chosen = sorted(g for held in target for g in held)
    mine = [g - first for g in chosen if first <= g < first + len(candidates[rank])]
    local = PackedBatch.concat(pool.parts).select([p * n + j for p in mine for j in range(n)])
    # Kept groups renumbered rank-then-local: the sample ids the coordinator's plan uses.
    position = {g: i for i, g in enumerate(chosen)}
    worker.coordinator.produce(node.id, local)
    worker.coordinator.regroup([[position[g] * n + j for g in held for j in range(n)] for held in target],
                               f"{node.id}/regroup")
    worker.coordinator.produce(node.id, _without_origin(worker.coordinator.batch))
    flat = [c for part in candidates for c in part]
    return sum(not flat[g][0] for g in chosen)


PPO_STAGES = {
    "values": run_values,
    "critic": run_critic_update,
    "reward_shaping": run_reward_shaping,
    "filter_groups": run_filter_groups,
}
