"""Policy-gradient losses: per-token losses plus clipping metrics.

Every loss has one signature::

    fn(old_log_probs [B, T], log_probs [B, T], advantages [B, T],
       response_mask [B, T], params: PolicyLossParams) -> PolicyLossOutput

and returns the per-token loss matrix unreduced: the trainer reduces it
with ``aggregate_loss`` so that micro-batches and dp ranks add up exactly.
Only ``response_mask`` 1 tokens (the model's own) count, in the loss and in
the metrics; a multi-turn response's tool tokens may hold any log-probs.
Semantics follow verl's ``compute_policy_loss_vanilla`` / ``_gspo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from distflow import names
from distflow.names import registry
from distflow.algorithms._registry import lookup
from distflow.algorithms.aggregation import masked_mean

# exp() of a larger log-ratio overflows float32 / bf16; verl clamps at the same bounds.
_MAX_TOKEN_LOG_RATIO = 20.0
_MAX_SEQ_LOG_RATIO = 10.0


@dataclass(frozen=True)
class PolicyLossParams:
    """Clip ranges: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""

    clip_ratio_low: float = 0.2
    """Lower clip epsilon."""
    clip_ratio_high: float = 0.2
    """Upper clip epsilon; above clip_ratio_low is DAPO's clip-higher (Yu et al. 2025)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound (Ye et al. 2020): for A < 0 the loss is at most -A * clip_ratio_c (vanilla only)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"PolicyLossParams.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if not self.clip_ratio_high >= 0.0:
            raise ValueError(f"PolicyLossParams.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"PolicyLossParams.clip_ratio_c must be > 1 (dual clip bounds the ratio from above), "
                f"got {self.clip_ratio_c}"
            )


@dataclass
class PolicyLossOutput:
    """Per-token policy loss and detached metrics."""

    pg_losses: Tensor
    """[B, T] per-token loss, to be reduced with aggregate_loss."""
    clipfrac: Tensor
    """Scalar: fraction of response tokens where the clipped term was taken."""
    clipfrac_lower: Tensor
    """Scalar: fraction of response tokens capped by the dual clip (A < 0)."""
    approx_kl: Tensor
    """Scalar: masked mean of old_log_probs - log_probs (verl's ppo_kl)."""


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossParams], PolicyLossOutput]


def vanilla_policy_loss(
    old_log_probs: Tensor, log_probs: Tensor, advantages: Tensor, response_mask: Tensor, params: PolicyLossParams
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual clip.

    r = exp(log_probs - old_log_probs) per token;
    L = max(-A r, -A clip(r, 1 - low, 1 + high)) (asymmetric bounds: DAPO, Yu et al. 2025);
    for A < 0, L = min(L, -A * clip_ratio_c) (dual clip, Ye et al. 2020).

    Args:
        old_log_probs: [B, T] log-probs of the behaviour policy (no grad).
        log_probs: [B, T] log-probs of the current policy (grad flows here).
        advantages: [B, T].
        response_mask: [B, T] 1 on the model's own tokens (0 on padding and tool tokens).
        params: clip ranges.

    Returns:
        PolicyLossOutput with pg_losses [B, T] and scalar metrics.
    """
    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_TOKEN_LOG_RATIO, _MAX_TOKEN_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * params.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    return PolicyLossOutput(
        pg_losses=pg_losses,
        clipfrac=masked_mean((clipped > unclipped).to(log_ratio.dtype), response_mask).detach(),
        clipfrac_lower=masked_mean(((ppo_losses > dual_bound) & negative).to(log_ratio.dtype), response_mask).detach(),
        approx_kl=masked_mean(-log_ratio, response_mask).detach(),
    )


def gspo_policy_loss(
    old_log_probs: Tensor, log_probs: Tensor, advantages: Tensor, response_mask: Tensor, params: PolicyLossParams
) -> PolicyLossOutput:
    """GSPO: clipped surrogate on the sequence-level ratio (Zheng et al. 2025).

    s_i = exp(mean_t (log_probs - old_log_probs)) over response tokens, used in
    its token form s_it = sg[s_i] * exp(log_p_it - sg[log_p_it]): the value of
    every token is s_i and the gradient of token t is s_i * grad log_p_it, so
    with ``seq-mean-token-mean`` aggregation the gradient equals that of the
    sequence-level objective. L = max(-A s, -A clip(s, 1 - low, 1 + high)).
    The paper uses tiny ranges (low 3e-4, high 4e-4); they come from params.
    GSPO has no dual clip: clipfrac_lower is 0.

    Args:
        old_log_probs: [B, T] log-probs of the behaviour policy (no grad).
        log_probs: [B, T] log-probs of the current policy (grad flows here).
        advantages: [B, T].
        response_mask: [B, T] 1 on the model's own tokens (0 on padding and tool tokens).
        params: clip ranges (clip_ratio_c unused).

    Returns:
        PolicyLossOutput with pg_losses [B, T] and scalar metrics.
    """
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=_MAX_SEQ_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    return PolicyLossOutput(
        pg_losses=pg_losses,
        clipfrac=masked_mean((clipped > unclipped).to(log_ratio.dtype), response_mask).detach(),
        clipfrac_lower=torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device),
        approx_kl=masked_mean(-log_ratio, response_mask).detach(),
    )


POLICY_LOSSES: dict[str, PolicyLossFn] = registry(names.POLICY_LOSSES, {
    "vanilla": vanilla_policy_loss,
    "gspo": gspo_policy_loss,
}, "algorithm.policyLoss")


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered as ``name`` in ``POLICY_LOSSES``.

    Raises:
        ValueError: unknown name; the message lists the choices.
    """
    return lookup(POLICY_LOSSES, name, "policy_loss")
