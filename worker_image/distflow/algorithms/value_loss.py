"""Critic loss with PPO value clipping, and the explained-variance metric."""

from __future__ import annotations

import torch
from torch import Tensor

from distflow.algorithms.aggregation import Reducer, masked_mean, masked_moments


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, cliprange_value: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss (Schulman et al. 2017; verl ``compute_value_loss``).

    v_clip = clip(values, old_values - c, old_values + c);
    loss = 0.5 * max((values - R)^2, (v_clip - R)^2) per token.

    Args:
        values: [B, T] current critic predictions (grad flows here).
        old_values: [B, T] critic predictions at rollout time.
        returns: [B, T] targets R.
        response_mask: [B, T] 1 on the model's own tokens (0 on padding and tool tokens).
        cliprange_value: c, in reward units.

    Returns:
        (vf_losses [B, T], to be reduced with aggregate_loss;
         vf_clipfrac scalar: fraction of response tokens where the clipped term was larger).

    Raises:
        ValueError: ``cliprange_value`` < 0.
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_losses = (values - returns) ** 2
    clipped_losses = (clipped_values - returns) ** 2
    vf_losses = 0.5 * torch.maximum(unclipped_losses, clipped_losses)
    vf_clipfrac = masked_mean((clipped_losses > unclipped_losses).to(values.dtype), response_mask).detach()
    return vf_losses, vf_clipfrac


@torch.no_grad()
def explained_variance(
    values: Tensor, returns: Tensor, response_mask: Tensor, reducer: Reducer | None = None
) -> Tensor:
    """1 - Var[R - V] / Var[R] over response tokens: 1 is a perfect critic, <= 0 no better than a constant.

    Args:
        values: [B, T] critic predictions V.
        returns: [B, T] targets R.
        response_mask: [B, T] 1 on the model's own tokens (0 on padding and tool tokens).
        reducer: sums a [5] vector of partial stats across dp ranks; None for this batch only.

    Returns:
        Scalar; NaN when the returns have zero variance.

    Raises:
        ValueError: fewer than 2 response tokens in total.
    """
    (_, var_residual), (_, var_returns) = masked_moments([returns - values, returns], response_mask, reducer)
    nan = torch.full_like(var_returns, float("nan"))
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns, nan)
