"""FlexAttention inputs for the shared-prompt rows: few shapes, one block mask per micro-batch.

On CUDA FlexAttention and its block mask are compiled kernels (inductor),
specialised to the row width S. Shared-prompt rows are as wide as their
longest prompt plus responses, so nearly every micro-batch would bring a new
S and a new compilation (seconds to minutes each, and past torch.compile's
recompile limit FlexAttention silently falls back to its slow eager form).
``bucketed_width`` pads S up to one of a few widths instead; the padding is
masked (no real token attends to it), so results do not change.

One micro-batch goes through several forwards in a step (reference,
old-policy and update passes, each PPO epoch again), each collating its rows
anew. ``block_mask`` keys the mask by the rows' segment ids and builds it the
first time only; ``forget_block_masks`` empties the cache (the worker does at
every step boundary), which also holds at most ``MAX_CACHED_MASKS``.
"""

from __future__ import annotations

import hashlib

import torch

FLEX_BLOCK = 128
"""FlexAttention's tile (tokens): block masks are kept per 128 x 128 tile."""
MAX_CACHED_MASKS = 256
"""Block masks kept at most; each holds its [g, S] segment ids and [g, 1, S/128, S/128] tile tables."""

_MASKS: dict[tuple, object] = {}


def bucketed_width(width: int) -> int:
    """The row width FlexAttention runs for rows of ``width`` tokens: the smallest of
    128, 256, 384, 512, 768, 1024, 1536, 2048, ... (powers of two and 1.5 x powers of two,
    from 256 on all multiples of the 128-token tile) that is >= ``width``.

    Rows up to W tokens take at most 2 log2(W / 128) + 1 widths; beyond 256 tokens padding
    adds less than half a row. A width of 0 stays 0.
    """
    bucket = FLEX_BLOCK
    while bucket < width:
        power = 1 << (bucket.bit_length() - 1)
        bucket = power * 3 // 2 if bucket == power and power >= 2 * FLEX_BLOCK else 2 * power
    return bucket if width > 0 else 0


def block_mask(rows, device: torch.device):
    """``rows.block_mask(device)``, built once for rows with these segment ids on ``device``.

    Args:
        rows: a ``model_ops.PrefixRows`` (its ``segment`` [g, S] decides the mask).
    """
    segment = rows.segment.contiguous()
    key = (str(device), tuple(segment.shape), hashlib.blake2b(segment.numpy().tobytes(), digest_size=16).digest())
    if key not in _MASKS:
        if len(_MASKS) >= MAX_CACHED_MASKS:
            del _MASKS[next(iter(_MASKS))]  # the oldest
        _MASKS[key] = rows.block_mask(device)
    return _MASKS[key]


def forget_block_masks() -> None:
    """Drop every cached block mask (their device memory goes with them)."""
    _MASKS.clear()
