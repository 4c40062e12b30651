"""Scoring a step's responses: outcome reward, reward shaping, advantages.

    reward          scores [B], token_level_scores [T_total] (the score on the model's last token)
    reward_shaping  token_level_rewards [T_total] = scores + overlong penalty - beta * KL
    advantage       advantages, returns [T_total] (from token_level_rewards when a node shaped them)

DAPO's group filter, which also scores its refill rounds, is in
``stages.group_filter``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from distflow.algorithms import (
    AdaptiveKLController, AdvantageInputs, AdvantageParams, FixedKLController, apply_kl_penalty,
    get_advantage_fn, overlong_penalty,
)
from distflow.data.batch import PackedBatch
from distflow.data.model_tokens import last_model_column, last_model_token, model_token_counts
from distflow.data.records import PromptRecord
from distflow.engines import model_ops
from distflow.engines.rollout import response_texts
from distflow.planner import PlannedNode
from distflow.rewards import compute_scores
from distflow.spec import KLControlSpec
from distflow.stages.context import StageContext, StageOutput


def score_responses(tokenizer, batch: PackedBatch, record_of: Mapping[int, PromptRecord],
                    reward_fn: str | None, where: str) -> tuple[list[str], list[PromptRecord], list[float]]:
    """Each response's text, its prompt's record (by ``group_index``) and its reward, in batch order.

    The reward is the reward function's score of the text, plus, for a multi-turn trajectory
    with an environment (``rollout.multiTurn.environment``), the rewards its ``step`` returned
    (``env_reward``, summed over the turns): a task scored by its environment alone gives a
    reward function that returns 0 (e.g. ``rewardFn: module:zero``).
    ``where`` (``at step 3``) goes into the message of a reward function that raises."""
    texts = response_texts(tokenizer, batch)
    records = [record_of[g] for g in batch.sample_fields["group_index"].tolist()]
    scores = compute_scores(texts, records, reward_fn, where)
    if (env := batch.sample_fields.get("env_reward")) is not None:
        scores = [s + e for s, e in zip(scores, env.tolist(), strict=True)]
    return texts, records, scores


def score_fields(batch: PackedBatch, scores: Sequence[float]) -> StageOutput:
    """``scores`` [B] and ``token_level_scores`` [T_total]: each outcome on its sample's last model token.

    That is the last ``response_mask`` 1 token, so a multi-turn trajectory cut off by the token
    budget inside a tool output still rewards the model's last action (``model_tokens``).
    """
    per_sample = torch.tensor(scores, dtype=torch.float32, device=batch.device)
    token_scores = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.device)
    token_scores[last_model_token(batch)] = per_sample
    return StageOutput(token={"token_level_scores": token_scores}, sample={"scores": per_sample})


def run_reward(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    _, _, scores = score_responses(ctx.tokenizer, batch, ctx.prompts, ctx.spec.data.reward_fn,
                                   f"at step {ctx.step + 1}")
    out = score_fields(batch, scores)
    per_sample = out.sample["scores"]
    ctx.metrics.add_mean("critic/score/mean", per_sample.double().sum(), per_sample.numel())
    ctx.metrics.add_max("critic/score/max", per_sample.max())
    ctx.metrics.add_min("critic/score/min", per_sample.min())
    return out


def build_kl_controller(ctrl: KLControlSpec) -> FixedKLController | AdaptiveKLController:
    """The in-reward KL coefficient of ``algorithm.klCtrl``."""
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)


def run_reward_shaping(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    """token_level_rewards from token_level_scores: DAPO's overlong penalty, then the KL penalty.

    The overlong penalty measures a response by the model's own tokens (the sum of its
    ``response_mask``; tool outputs of a multi-turn sample are not the model's verbosity) and
    sits with the outcome, on the model's last token.
    """
    spec, alg = ctx.spec, ctx.spec.algorithm
    mb = model_ops.collate(batch, ctx.tokenizer.pad_token_id)
    rewards = model_ops.window_field(mb, "token_level_scores").float()
    if alg.overlong_buffer.enable:
        buffer = alg.overlong_buffer.length or max(1, spec.data.max_response_length // 4)
        penalty = overlong_penalty(model_token_counts(batch), spec.data.max_response_length,
                                   buffer, alg.overlong_buffer.penalty_factor)
        rows = torch.arange(rewards.shape[0], device=rewards.device)
        rewards[rows, last_model_column(mb.response_mask).to(rewards.device)] += penalty.to(rewards.device)
        ctx.metrics.add_mean("reward/overlong_penalty/mean", penalty.double().sum(), penalty.numel())
        ctx.metrics.add_mean("reward/overlong_frac", (penalty < 0).double().sum(), penalty.numel())
    if alg.use_kl_in_reward:
        rewards = _kl_in_reward(ctx, mb, rewards)
    ctx.metrics.add_mean("critic/rewards/mean", (rewards * mb.response_mask).double().sum(), batch.num_samples)
    return StageOutput(token={"token_level_rewards": model_ops.unwindow(mb, rewards)})


def _kl_in_reward(ctx: StageContext, mb: model_ops.MicroBatch, rewards: torch.Tensor) -> torch.Tensor:
    """rewards - beta * KL(actor || reference) per token; steps the (adaptive) coefficient on the global KL."""
    beta = ctx.kl_ctrl.value
    rewards, mean_kl = apply_kl_penalty(rewards, model_ops.window_field(mb, "old_log_probs"),
                                        model_ops.window_field(mb, "ref_log_probs"), mb.response_mask,
                                        beta, ctx.spec.algorithm.kl_penalty)
    num = mb.response_mask.shape[0]
    sums = ctx.reduce(torch.tensor([float(mean_kl) * num, float(num)], dtype=torch.float64, device=ctx.device))
    global_kl = float(sums[0] / sums[1].clamp_min(1.0))
    ctx.kl_ctrl.update(global_kl, int(sums[1]))
    ctx.metrics.add_mean("actor/reward_kl_penalty", global_kl, 1.0)
    ctx.metrics.add_mean("actor/reward_kl_penalty_coeff", beta, 1.0)
    return rewards


def run_advantage(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    alg = ctx.spec.algorithm
    mb = model_ops.collate(batch, ctx.tokenizer.pad_token_id)
    # A reward_shaping node (overlong penalty, KL in reward) sets token_level_rewards; else scores are rewards.
    rewards = "token_level_rewards" if "token_level_rewards" in batch.token_fields else "token_level_scores"
    inputs = AdvantageInputs(
        token_level_rewards=model_ops.window_field(mb, rewards),
        response_mask=mb.response_mask,
        group_index=batch.sample_fields["group_index"],
        values=model_ops.window_field(mb, "values") if "values" in batch.token_fields else None,
    )
    params = AdvantageParams(gamma=alg.gamma, lam=alg.lam, norm_adv_by_std=alg.norm_adv_by_std)
    advantages, returns = get_advantage_fn(alg.advantage_estimator)(inputs, params, ctx.reduce)
    mask = mb.response_mask
    ctx.metrics.add_mean("critic/advantages/mean", (advantages * mask).double().sum(), mask.sum())
    return StageOutput(token={"advantages": model_ops.unwindow(mb, advantages),
                              "returns": model_ops.unwindow(mb, returns)})
