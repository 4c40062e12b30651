"""Reward shaping applied before advantages: DAPO's soft overlong punishment.

The KL-in-reward penalty lives with the other KL code (``kl.apply_kl_penalty``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong punishment (Yu et al. 2025, DAPO, eq. 13), times ``penalty_factor``.

    With L = max_response_length and C = buffer_length, a response of |y| tokens gets
    0 when |y| <= L - C, (L - C - |y|) / C inside the buffer, and -1 beyond L:
    the penalty ramps linearly from 0 to -penalty_factor over the last C tokens.

    Args:
        response_lengths: [B] response tokens per sample (EOS included). For a multi-turn
            response the scoring stage passes the model's own tokens (the sum of its
            ``response_mask``): tool outputs are not the model's verbosity.
        max_response_length: L, tokens.
        buffer_length: C, tokens, 1 <= C <= L.
        penalty_factor: the penalty at |y| >= L.

    Returns:
        [B] float32 penalties, <= 0, to add to the task scores.

    Raises:
        ValueError: ``buffer_length`` outside 1..max_response_length.
    """
    if not 1 <= buffer_length <= max_response_length:
        raise ValueError(
            f"algorithm.overlongBuffer.length: {buffer_length} must be in 1..{max_response_length} "
            "(data.maxResponseLength)"
        )
    expected = max_response_length - buffer_length
    exceed = (response_lengths.to(torch.float32) - expected) / buffer_length
    return -exceed.clamp(0.0, 1.0) * penalty_factor
