"""KL between the actor and the reference policy: estimators, coefficient controllers, reward penalty.

Estimators are per-token, from sampled tokens only (Schulman 2020,
"Approximating KL Divergence"), with verl's names and clamps. The same
estimator serves both uses: a penalty folded into the rewards
(``apply_kl_penalty``, PPO-style) or a loss term the trainer aggregates
with ``aggregate_loss`` (GRPO-style ``use_kl_loss``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from distflow import names
from distflow.names import registry
from distflow.algorithms._registry import lookup
from distflow.algorithms.aggregation import masked_mean

KLEstimator = Callable[[Tensor, Tensor], Tensor]

# exp(ref - logp) overflows past this; the k3 value itself is clamped as verl does, which
# bounds the gradient from rare tokens the reference finds very unlikely.
_MAX_K3_LOG_RATIO = 20.0
_MAX_K3 = 10.0


def k1_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1 = log p - log ref per token: unbiased for KL(p || ref), high variance, can be < 0.

    Args:
        log_probs: [B, T] actor log-probs of the sampled tokens.
        ref_log_probs: [B, T] reference log-probs of the same tokens.

    Returns:
        [B, T] (not masked).
    """
    return log_probs - ref_log_probs


def abs_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """|log p - log ref| per token ([B, T], not masked)."""
    return (log_probs - ref_log_probs).abs()


def k2_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2 = 0.5 * (log p - log ref)^2 per token ([B, T], not masked); >= 0, biased (Schulman 2020)."""
    return 0.5 * (log_probs - ref_log_probs).square()


def k3_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 per token (Schulman 2020), verl's ``low_var_kl``.

    Unbiased for KL(p || ref) and >= 0 since e^x >= 1 + x; clamped to [-10, 10]
    as in verl.

    Args:
        log_probs: [B, T] actor log-probs of the sampled tokens.
        ref_log_probs: [B, T] reference log-probs of the same tokens.

    Returns:
        [B, T] (not masked).
    """
    log_ratio = (ref_log_probs - log_probs).clamp(-_MAX_K3_LOG_RATIO, _MAX_K3_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-_MAX_K3, _MAX_K3)


KL_ESTIMATORS: dict[str, KLEstimator] = registry(names.KL_ESTIMATORS, {
    "k1": k1_kl,
    "k2": k2_kl,
    "k3": k3_kl,
    "low_var_kl": k3_kl,
    "abs": abs_kl,
}, "algorithm.klLossType")


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator registered as ``name`` in ``KL_ESTIMATORS``.

    Raises:
        ValueError: unknown name; the message lists the choices.
    """
    return lookup(KL_ESTIMATORS, name, "kl_estimator")


class FixedKLController:
    """Constant KL coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op, so callers treat both controllers alike."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller driving the observed KL towards a target (Ziegler et al. 2019).

    After each batch: e = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 (samples), got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after a batch of ``n_steps`` samples with mean KL ``current_kl`` (nats)."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    estimator: str,
) -> tuple[Tensor, Tensor]:
    """Fold a per-token KL penalty into the rewards (Ziegler et al. 2019; verl ``apply_kl_penalty``).

    rewards = scores - kl_coef * kl * mask.

    Args:
        token_level_scores: [B, T] task reward on tokens.
        log_probs: [B, T] actor (rollout-time) log-probs.
        ref_log_probs: [B, T] reference log-probs.
        response_mask: [B, T] 1 on the model's own tokens; a multi-turn response's tool tokens (0)
            get no penalty and do not count in mean_kl.
        kl_coef: penalty weight, e.g. a controller's ``value``.
        estimator: a name in ``KL_ESTIMATORS``.

    Returns:
        (token_level_rewards [B, T], mean_kl scalar): mean_kl is this batch's
        mean over sequences of the per-sequence token-mean KL, the quantity
        the adaptive controller expects; average it across dp ranks first.

    Raises:
        ValueError: unknown ``estimator``.
    """
    # where, not * mask: the log-probs of mask-0 tokens (a multi-turn response's tool tokens) may be anything.
    kl = torch.where(response_mask.bool(), get_kl_estimator(estimator)(log_probs, ref_log_probs), 0.0)
    rewards = token_level_scores - kl_coef * kl
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return rewards, mean_kl
