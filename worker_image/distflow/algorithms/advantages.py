"""Advantage estimators: rewards (and critic values) -> per-token advantages and returns.

Semantics follow verl's ``core_algos.py``; the code is written afresh and
vectorised over groups (``torch.unique`` + ``index_add_``) instead of Python
dicts. Every estimator has one signature::

    fn(inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None)
        -> (advantages [B, T], returns [B, T])

Group-based estimators (grpo, drgrpo, rloo, reinforce_plus_plus_baseline)
need every sample of a prompt group in the same call: they compute group
statistics locally. Estimators that whiten over the whole batch
(reinforce_plus_plus, reinforce_plus_plus_baseline, gae) use ``reducer`` to
sum their partial statistics across dp ranks; the others ignore it.

Multi-turn responses: ``response_mask`` is 1 only on the model's own
tokens; tool outputs and chat-template tokens between turns are 0. Outcome
advantages (grpo, drgrpo, rloo, reinforce_plus_plus_baseline) are broadcast
over the 1s only; gae and reinforce_plus_plus run their recursions over the
model's tokens only, skipping the 0s (verl's multi-turn GAE). On a
single-turn response (one run of 1s) nothing is skipped and the results
are the standard ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from distflow.names import ADVANTAGE_ESTIMATORS, registry
from distflow.algorithms._registry import lookup
from distflow.algorithms.aggregation import Reducer, masked_whiten


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads, for one batch of B responses of T tokens."""

    token_level_rewards: Tensor
    """[B, T] reward placed on tokens (an outcome reward sits on the model's last token)."""
    response_mask: Tensor
    """[B, T] 1 on the model's own tokens; 0 on padding, prompt and a multi-turn response's tool tokens."""
    group_index: Tensor
    """[B] int64 id of the prompt group each sample belongs to."""
    values: Tensor | None = None
    """[B, T] critic values; gae only."""

    def __post_init__(self) -> None:
        if self.token_level_rewards.dim() != 2:
            raise ValueError(
                f"AdvantageInputs.token_level_rewards must be [B, T], got shape {tuple(self.token_level_rewards.shape)}"
            )
        shape = self.token_level_rewards.shape
        for name in ("response_mask", "values"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != shape:
                raise ValueError(
                    f"AdvantageInputs.{name} must match token_level_rewards {tuple(shape)}, got {tuple(tensor.shape)}"
                )
        if self.group_index.shape != shape[:1]:
            raise ValueError(
                f"AdvantageInputs.group_index must be [B] = [{shape[0]}], got {tuple(self.group_index.shape)}"
            )


@dataclass(frozen=True)
class AdvantageParams:
    """Hyperparameters shared by the estimators; each reads only the ones it needs."""

    gamma: float = 1.0
    """Discount per token (reinforce_plus_plus, gae)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    norm_adv_by_std: bool = True
    """Divide by the group std (grpo)."""
    epsilon: float = 1e-6
    """Added to the group std before dividing (grpo)."""

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"AdvantageParams.{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.epsilon > 0.0:
            raise ValueError(f"AdvantageParams.epsilon must be > 0, got {self.epsilon}")


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams, Reducer | None], tuple[Tensor, Tensor]]


def _sequence_scores(inputs: AdvantageInputs) -> Tensor:
    """[B] outcome score of each response: the sum of its token rewards."""
    return inputs.token_level_rewards.sum(dim=-1)


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each [B].

    A group of size 1 gets mean 0 and std 1, as in verl, so its advantage is
    its raw score rather than 0/0.
    """
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sizes = counts.to(scores.dtype)
    mean = torch.zeros_like(sizes).index_add_(0, inverse, scores) / sizes
    squares = torch.zeros_like(sizes).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(squares / (sizes - 1).clamp_min(1))
    singleton = counts == 1
    mean = mean.masked_fill(singleton, 0.0)
    std = std.masked_fill(singleton, 1.0)
    return mean[inverse], std[inverse], counts[inverse]


def _broadcast(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """[B] -> [B, T] on the model's tokens, zero elsewhere (tool tokens included)."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


@torch.no_grad()
def grpo_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath).

    A_i = (score_i - mean_g) / (std_g + epsilon) on every response token,
    with mean and unbiased std (``torch.std``) over the prompt group g; no
    std division when ``params.norm_adv_by_std`` is False. ``reducer`` is unused.

    Returns:
        (advantages [B, T], returns [B, T]); returns equal advantages.
    """
    scores = _sequence_scores(inputs)
    mean, std, _ = _group_stats(scores, inputs.group_index)
    centered = scores - mean
    if params.norm_adv_by_std:
        centered = centered / (std + params.epsilon)
    advantages = _broadcast(centered, inputs.response_mask)
    return advantages, advantages


def drgrpo_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantage (Liu et al. 2025): score minus group mean, never divided by the std.

    The paper's other change, a constant length normalizer, is the loss
    aggregation mode ``seq-mean-token-sum-norm``. ``reducer`` is unused.

    Returns:
        (advantages [B, T], returns [B, T]); returns equal advantages.
    """
    return grpo_advantages(inputs, replace(params, norm_adv_by_std=False), reducer)


@torch.no_grad()
def rloo_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """RLOO leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").

    A_i = score_i - mean_{j != i} score_j = (score_i - mean_g) * n / (n - 1).
    A group of size 1 keeps its raw score, as in verl. ``reducer`` is unused.

    Returns:
        (advantages [B, T], returns [B, T]); returns equal advantages.
    """
    scores = _sequence_scores(inputs)
    mean, _, counts = _group_stats(scores, inputs.group_index)
    sizes = counts.to(scores.dtype)
    # n=1: scale 1 and mean 0 leave the raw score.
    scale = sizes / (sizes - 1).clamp_min(1)
    advantages = _broadcast(scores * scale - mean * scale, inputs.response_mask)
    return advantages, advantages


def _discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """[B, T] G_t = r_t + gamma * G_{t'} over the model's tokens, t' the next one with mask 1.

    Mask-0 positions (padding, a multi-turn response's tool tokens) are skipped: their reward
    is ignored, they are not discounted over, and they hold the return of the next model token.
    """
    mask = response_mask.bool()
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted token returns, whitened over the global batch.

    Args:
        reducer: sums whitening statistics across dp ranks; None for this batch only.

    Returns:
        (advantages [B, T] whitened and masked, returns [B, T] discounted with ``params.gamma``).

    Raises:
        ValueError: fewer than 2 response tokens in the global batch.
    """
    returns = _discounted_returns(inputs.token_level_rewards, inputs.response_mask, params.gamma)
    mask = inputs.response_mask.to(returns.dtype)
    advantages = masked_whiten(returns, mask, reducer) * mask
    return advantages, returns


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): score minus group mean, then global-batch whitening.

    Args:
        reducer: sums whitening statistics across dp ranks; None for this batch only.

    Returns:
        (advantages [B, T], returns [B, T]); returns equal advantages.

    Raises:
        ValueError: fewer than 2 response tokens in the global batch.
    """
    scores = _sequence_scores(inputs)
    mean, _, _ = _group_stats(scores, inputs.group_index)
    mask = inputs.response_mask.to(scores.dtype)
    centered = _broadcast(scores - mean, mask)
    advantages = masked_whiten(centered, mask, reducer) * mask
    return advantages, advantages


@torch.no_grad()
def gae_advantages(
    inputs: AdvantageInputs, params: AdvantageParams, reducer: Reducer | None = None
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over the model's tokens.

    delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lam * A_{t'}, where t' is
    the next position with ``response_mask`` 1, and V_{t'} = A_{t'} = 0 past the last one.
    Mask-0 positions inside a multi-turn response (tool outputs, chat template) are skipped:
    their rewards and values are ignored, so the model token before a tool segment bootstraps
    from the value of the first model token after it, undiscounted by the segment's length.
    This is verl's ``compute_gae_advantage_return`` since its multi-turn change ("skip values
    and TD-error on observation tokens", verl/trainer/ppo/core_algos.py). On a single-turn
    response nothing is skipped: the standard recursion. Returns are A + V before
    whitening; advantages are then whitened over the global batch's model tokens.

    Args:
        inputs: needs ``values`` [B, T].
        reducer: sums whitening statistics across dp ranks; None for this batch only.

    Returns:
        (advantages [B, T] whitened and masked, returns [B, T]).

    Raises:
        ValueError: ``inputs.values`` is None, or fewer than 2 response tokens globally.
    """
    if inputs.values is None:
        raise ValueError("AdvantageInputs.values: gae needs critic values [B, T]; pass the critic's values")
    rewards = inputs.token_level_rewards
    on_model = inputs.response_mask.bool()
    mask = inputs.response_mask.to(rewards.dtype)
    values = torch.where(on_model, inputs.values.to(rewards.dtype), 0.0)
    advantages = torch.empty_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + params.gamma * next_value - values[:, t]
        # A mask-0 position passes the next model token's value and advantage on unchanged.
        last_advantage = torch.where(on_model[:, t], delta + params.gamma * params.lam * last_advantage,
                                     last_advantage)
        advantages[:, t] = last_advantage
        next_value = torch.where(on_model[:, t], values[:, t], next_value)
    returns = advantages + values
    return masked_whiten(advantages, mask, reducer) * mask, returns


ADVANTAGES: dict[str, AdvantageFn] = registry(ADVANTAGE_ESTIMATORS, {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "gae": gae_advantages,
}, "algorithm.advantageEstimator")


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as ``name`` in ``ADVANTAGES``.

    Raises:
        ValueError: unknown name; the message lists the choices.
    """
    return lookup(ADVANTAGES, name, "adv_estimator")
