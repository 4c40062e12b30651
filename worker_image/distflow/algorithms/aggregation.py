"""Masked reductions and loss aggregation that stay exact under data parallelism.

A global (mini-)batch is split over dp ranks and, on each rank, over
micro-batches. The caller knows the global normalizer up front (response
tokens or sequences in the whole global batch, summed over dp ranks), so each
micro-batch returns its *contribution* and the contributions simply add up:
summing them over micro-batches and ranks gives the loss of the whole batch
computed in one process, for every mode. The four modes are verl's
(``agg_loss`` in core_algos.py); only the way the divisor is obtained differs.

Statistics that must span the global batch (whitening, explained variance)
take a ``reducer``: a callable that all-reduces (sums) a short vector of
partial sums across dp ranks. Everything is reduced in one call, so a
distributed caller pays one collective per statistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from distflow.names import LOSS_AGG_MODES

Reducer = Callable[[Tensor], Tensor]
"""Sums a 1-D tensor of partial sums across dp ranks (all-reduce SUM); identity on one rank."""


# Added to the variance before rsqrt, as verl does, so a constant batch whitens to 0, not NaN.
_WHITEN_EPS = 1e-8


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1; what ``values`` holds where it is 0 (even inf or NaN) never counts.

    Args:
        values: any shape, e.g. [B, T].
        mask: same shape, 0/1 (bool, int or float).
        dim: reduce this dimension only; all of them when None.
    """
    # where, not values * mask: inf * 0 is NaN, and masked positions (a multi-turn response's
    # tool tokens, padding) may hold anything.
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where the 0/1 ``mask`` is 1; an all-zero mask gives 0, not NaN.

    Args:
        values: any shape, e.g. [B, T].
        mask: same shape, 0/1.
        dim: reduce this dimension only (e.g. -1 for a per-sequence mean [B]); all when None.
    """
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def masked_moments(series: list[Tensor], mask: Tensor, reducer: Reducer | None = None) -> list[tuple[Tensor, Tensor]]:
    """(mean, unbiased variance) of each tensor in ``series`` where ``mask`` is 1, across dp ranks.

    The partial (count, sum_1, sum_sq_1, sum_2, ...) vector, [1 + 2 * len(series)],
    goes through ``reducer`` in one call. Sums are float64 because the one-pass
    variance subtracts two large numbers.

    Args:
        series: tensors shaped like ``mask``, e.g. [B, T].
        mask: 0/1.
        reducer: all-reduce SUM across dp ranks; None for these tensors only.

    Returns:
        One (mean, var) pair of scalars per tensor, in that tensor's dtype.

    Raises:
        ValueError: fewer than 2 unmasked elements in total (unbiased variance undefined).
    """
    mask64 = mask.to(torch.float64)
    partial = [mask64.sum()]
    for values in series:
        masked = values.to(torch.float64) * mask64
        partial += [masked.sum(), (masked * masked).sum()]
    sums = torch.stack(partial)
    if reducer is not None:
        sums = reducer(sums)
    count = sums[0]
    if count < 2:
        raise ValueError(
            f"response_mask: need at least 2 unmasked elements over all ranks for a variance, "
            f"got {int(count.item())}; check that responses are not empty"
        )
    moments = []
    for i, values in enumerate(series):
        mean = sums[1 + 2 * i] / count
        var = ((sums[2 + 2 * i] - count * mean * mean) / (count - 1)).clamp_min(0.0)
        moments.append((mean.to(values.dtype), var.to(values.dtype)))
    return moments


def masked_var(values: Tensor, mask: Tensor, reducer: Reducer | None = None) -> Tensor:
    """Unbiased (Bessel-corrected, like verl) variance of ``values`` where ``mask`` is 1.

    Args:
        values: any shape, e.g. [B, T].
        mask: same shape, 0/1.
        reducer: sums a [3] vector of partial stats across dp ranks for a global
            variance; None for this tensor only.

    Raises:
        ValueError: fewer than 2 unmasked elements in total.
    """
    ((_, var),) = masked_moments([values], mask, reducer)
    return var


def masked_whiten(values: Tensor, mask: Tensor, reducer: Reducer | None = None, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with masked, optionally global, statistics.

    Mean and unbiased variance come from (count, sum, sum of squares) over
    the unmasked elements, summed across dp ranks by ``reducer`` in one call,
    so whitening each rank's shard equals whitening their concatenation.
    Masked positions are transformed too; multiply by the mask if they must be 0.

    Args:
        values: [B, T].
        mask: [B, T], 0/1.
        reducer: all-reduce SUM of a [3] tensor across dp ranks; None for local stats.
        shift_mean: when False, add the mean back (scale only), as verl's option.

    Returns:
        [B, T] whitened values.

    Raises:
        ValueError: fewer than 2 unmasked elements in total.
    """
    ((mean, var),) = masked_moments([values], mask, reducer)
    whitened = (values - mean) * torch.rsqrt(var + _WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


@dataclass(frozen=True)
class LossNormalizer:
    """Sizes of the whole global (mini-)batch that one optimizer step sees, over all dp ranks."""

    global_num_tokens: float
    """The model's own response tokens (sum of response_mask; a multi-turn sample's tool tokens
    excluded) in the global batch."""
    global_num_seqs: float
    """Sequences in the global batch."""
    max_response_length: int
    """Longest allowed response, in tokens: Dr. GRPO's constant divisor."""

    def __post_init__(self) -> None:
        for name in ("global_num_tokens", "global_num_seqs", "max_response_length"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(
                    f"LossNormalizer.{name} must be > 0, got {getattr(self, name)}; "
                    "count it over the whole global batch on all dp ranks"
                )


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, mode: str, normalizer: LossNormalizer) -> Tensor:
    """This micro-batch's additive share of the global-batch loss.

    Summing the returns over all micro-batches on all dp ranks gives exactly
    the loss of the whole global batch computed at once (verl ``agg_loss``):

    - ``token-mean``: sum(loss * mask) / global_num_tokens
    - ``seq-mean-token-sum``: sum_i sum_t loss_it / global_num_seqs
    - ``seq-mean-token-mean``: sum_i mean_t loss_it / global_num_seqs
      (a sequence with no response tokens adds 0)
    - ``seq-mean-token-sum-norm``: sum(loss * mask) / (global_num_seqs * max_response_length)
      (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training")

    Gradients add up the same way, so the sum over ranks must be a SUM; if the
    gradient reduction averages over dp ranks (FSDP's default), scale the
    loss by the dp size.

    Args:
        loss_mat: [B, T] per-token loss; what it holds where the mask is 0 never counts.
        response_mask: [B, T] 1 on the model's own tokens: a token-mean of a multi-turn response
            is over its model tokens, tool tokens (mask 0) neither add loss nor count.
        mode: one of ``LOSS_AGG_MODES``.
        normalizer: sizes of the global batch.

    Returns:
        Scalar tensor (differentiable w.r.t. ``loss_mat``).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode == "token-mean":
        return masked_sum(loss_mat, response_mask) / normalizer.global_num_tokens
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, response_mask) / normalizer.global_num_seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, response_mask, dim=-1).sum() / normalizer.global_num_seqs
    if mode == "seq-mean-token-sum-norm":
        divisor = normalizer.global_num_seqs * normalizer.max_response_length
        return masked_sum(loss_mat, response_mask) / divisor
    raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
