"""Per-token log-probs and entropy from model logits.

Vocabularies are large (150k), so a float32 log_softmax over a whole bf16
batch at once would double or triple peak memory. Both functions work on
chunks of rows, upcast each chunk to float32 (logsumexp in bf16 loses about
two digits), and return float32 (float64 stays float64). In no-grad passes
(reference, old log-probs) only one chunk is live at a time; under autograd
each chunk's float32 copy is kept for backward, as a plain log_softmax would.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows (tokens) per chunk: 1024 x 150k vocab x 4 bytes = 600 MB transient in float32.
_ROWS_PER_CHUNK = 1024


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def log_probs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per position, as logit[label] - logsumexp(logits).

    Args:
        logits: [B, T, V] (or [T_total, V] for packed sequences; any leading shape).
        labels: [B, T] int64 token ids (same leading shape as logits).

    Returns:
        [B, T] log-probs, float32 (float64 if the logits are), differentiable.

    Raises:
        ValueError: ``labels`` shape does not match ``logits`` without the vocab dim.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have the shape of logits without the vocab dim, "
            f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    dtype = _compute_dtype(logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1)
    chunks = []
    for rows, row_labels in zip(flat_logits.split(_ROWS_PER_CHUNK), flat_labels.split(_ROWS_PER_CHUNK), strict=True):
        rows = rows.to(dtype)
        chunks.append(rows.gather(-1, row_labels).squeeze(-1) - torch.logsumexp(rows, dim=-1))
    return torch.cat(chunks).reshape(labels.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: logsumexp(z) - sum softmax(z) * z (nats).

    Args:
        logits: [B, T, V] (any leading shape), finite (a -inf logit makes 0 * -inf = NaN).

    Returns:
        [B, T] entropy, float32 (float64 if the logits are), differentiable.
    """
    dtype = _compute_dtype(logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunks = []
    for rows in flat_logits.split(_ROWS_PER_CHUNK):
        rows = rows.to(dtype)
        chunks.append(torch.logsumexp(rows, dim=-1) - (torch.softmax(rows, dim=-1) * rows).sum(dim=-1))
    return torch.cat(chunks).reshape(logits.shape[:-1])
