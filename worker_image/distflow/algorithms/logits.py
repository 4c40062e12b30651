"""Per-token log-probs and entropy from model logits, without float32 copies of the logits.

Vocabularies are large (150k): a float32 ``[b, R, V]`` copy of a bf16 batch's
logits is 2-3x the logits themselves, and a plain ``log_softmax`` under
autograd keeps one (or several: softmax, the entropy's product) for backward.
``log_probs_and_entropy`` works on blocks of about ``_ROWS_PER_CHUNK``
positions: each block is upcast to float32 (logsumexp in bf16 loses about two
digits), tempered, and reduced to a log-prob and an entropy per position. For
backward it keeps only the logits it was given (no copy) and two floats per
position, and recomputes each block's softmax in backward, writing the
gradient straight into one tensor of the logits' shape and dtype. So at most
two or three float32 blocks are live at a time, forward or backward. Entropy
takes part in backward only when asked (``entropy_grad``: an entropy bonus).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Positions per block: 1024 x 150k vocab x 4 bytes = 600 MB transient in float32.
_ROWS_PER_CHUNK = 1024


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _blocks(shape: torch.Size) -> list[tuple[slice, slice]]:
    """(batch slice, position slice) blocks of about ``_ROWS_PER_CHUNK`` positions of a [B, T] grid."""
    batch, length = shape
    if length >= _ROWS_PER_CHUNK:
        return [(slice(i, i + 1), slice(s, s + _ROWS_PER_CHUNK))
                for i in range(batch) for s in range(0, length, _ROWS_PER_CHUNK)]
    rows = max(1, _ROWS_PER_CHUNK // max(length, 1))
    return [(slice(i, i + rows), slice(0, length)) for i in range(0, batch, rows)]


def _scaled(block: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """A float32 (float64) copy of a logits block divided by the temperature (0 and 1: unchanged)."""
    block = block.to(dtype, copy=True)
    return block.div_(temperature) if temperature > 0 and temperature != 1.0 else block


class _LogProbsAndEntropy(torch.autograd.Function):
    """Blockwise log softmax(z / t)[label] and entropy; backward recomputes each block's softmax.

    d log p_y / dx = onehot(y) - p and dH / dx = -p (log p + H), for x = z / t.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, entropy_grad: bool):
        dtype = _compute_dtype(logits)
        log_probs = torch.empty(labels.shape, dtype=dtype, device=logits.device)
        lse, entropy = torch.empty_like(log_probs), torch.empty_like(log_probs)
        for rows, cols in _blocks(labels.shape):
            x = _scaled(logits[rows, cols], dtype, temperature)
            block_lse = torch.logsumexp(x, dim=-1)
            probs = (x - block_lse.unsqueeze(-1)).exp_()
            lse[rows, cols] = block_lse
            log_probs[rows, cols] = x.gather(-1, labels[rows, cols].unsqueeze(-1)).squeeze(-1) - block_lse
            entropy[rows, cols] = block_lse - (probs.unsqueeze(-2) @ x.unsqueeze(-1)).flatten(-3)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        logits, labels, lse, entropy = ctx.saved_tensors
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        grad_logits = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(labels.shape):
            x = _scaled(logits[rows, cols], lse.dtype, ctx.temperature)
            block_lse = lse[rows, cols].unsqueeze(-1)
            probs = (x - block_lse).exp()
            # grad_x = -p * (g_lp + g_H * (log p + H)) + g_lp * onehot(label), built in x's buffer.
            if grad_entropy is not None:
                x.sub_(block_lse).add_(entropy[rows, cols].unsqueeze(-1)).mul_(grad_entropy[rows, cols].unsqueeze(-1))
            else:
                x.zero_()
            if grad_log_probs is not None:
                g = grad_log_probs[rows, cols].unsqueeze(-1)
                x.add_(g).mul_(probs).neg_().scatter_add_(-1, labels[rows, cols].unsqueeze(-1), g)
            else:
                x.mul_(probs).neg_()
            grad_logits[rows, cols] = x.div_(t)
        return grad_logits, None, None, None


def log_probs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """log softmax(logits / t)[label] and the entropy of softmax(logits / t) per position.

    Args:
        logits: [B, T, V] (or [T_total, V]), any float dtype, finite (a -inf
            logit makes 0 * -inf = NaN in the entropy). May be a view: it is
            neither copied nor upcast as a whole.
        labels: [B, T] int64 token ids (the leading shape of ``logits``).
        temperature: sampling temperature t (0, greedy, and 1 leave the logits as they are).
        entropy_grad: let the entropy take part in backward (an entropy bonus needs it);
            otherwise it is returned as a constant.

    Returns:
        (log_probs [B, T], entropy [B, T] in nats), float32 (float64 if the logits are).

    Raises:
        ValueError: ``labels`` shape does not match ``logits`` without the vocab dim.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have the shape of logits without the vocab dim, "
            f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    grid = logits.unsqueeze(0) if logits.dim() == 2 else logits.reshape(-1, *logits.shape[-2:])
    log_probs, entropy = _LogProbsAndEntropy.apply(grid, labels.reshape(grid.shape[:-1]), temperature,
                                                   entropy_grad)
    return log_probs.reshape(labels.shape), entropy.reshape(labels.shape)


def log_probs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per position: [B, T] (see ``log_probs_and_entropy``)."""
    return log_probs_and_entropy(logits, labels)[0]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position, differentiable: [B, T] nats (see ``log_probs_and_entropy``)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return log_probs_and_entropy(logits, labels, entropy_grad=True)[1]
