"""Collation and forward passes shared by the actor, reference and critic.

A step's samples travel packed (``PackedBatch``: token fields ``[T_total]``
spanning prompt + response, ``response_mask`` 1 on generated tokens). For a
forward pass a micro-batch is left-padded into ``[b, L]`` so that every
response ends at column L-1; the model then only needs logits for the last
``R + 1`` positions (``logits_to_keep``), R = the longest response. Prompt
tokens never go through the LM head, which on a 49k vocabulary is a large
share of the FLOPs.

Every per-token tensor the algorithms see is this *response window*
``[b, R]``: column j of row i is token ``L - R + j`` of that row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from distflow.algorithms import entropy_from_logits, log_probs_from_logits
from distflow.data.batch import PackedBatch, from_padded


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's inputs."""

    input_ids: torch.Tensor
    """[b, L] int64, left-padded."""
    attention_mask: torch.Tensor
    """[b, L] 1 on real tokens."""
    position_ids: torch.Tensor
    """[b, L] positions counted from each row's first real token (as in generation)."""
    response_mask: torch.Tensor
    """[b, R] float, 1 on generated tokens in the response window."""
    source: PackedBatch
    """The packed samples this micro-batch came from."""

    @property
    def window(self) -> int:
        """R: columns in the response window."""
        return self.response_mask.shape[1]


def collate(batch: PackedBatch, pad_token_id: int) -> MicroBatch:
    """Left-pad packed samples for a forward pass.

    Needs token fields ``input_ids`` and ``response_mask`` ([T_total]).
    """
    lens = batch.seq_lens
    width = int(lens.max())
    input_ids = batch.to_padded("input_ids", pad_value=pad_token_id, max_len=width, left_pad=True)
    attention_mask = (torch.arange(width).unsqueeze(0) >= (width - lens).unsqueeze(1)).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    resp_full = batch.to_padded("response_mask", pad_value=0, max_len=width, left_pad=True)
    window = max(1, int(batch.sample_fields["response_len"].max()))
    return MicroBatch(input_ids, attention_mask, position_ids,
                      resp_full[:, -window:].float(), batch)


def window_field(mb: MicroBatch, name: str) -> torch.Tensor:
    """Token field ``name`` of the micro-batch as its response window ``[b, R]``."""
    width = mb.input_ids.shape[1]
    return mb.source.to_padded(name, pad_value=0, max_len=width, left_pad=True)[:, -mb.window:]


def unwindow(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``window_field``: ``[b, R]`` -> packed ``[T_total]`` with 0 on prompt tokens."""
    full = values.new_zeros(mb.input_ids.shape)
    full[:, -mb.window:] = values * mb.response_mask.to(values.dtype)
    return from_padded(full, mb.source.seq_lens, left_pad=True)


def autocast(mixed_precision: str, device: torch.device):
    """bf16 autocast when asked (fp32 master weights stay fp32)."""
    if mixed_precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_log_probs(model, mb: MicroBatch, temperature: float, with_entropy: bool,
                      mixed_precision: str = "none"):
    """Log-probabilities of the response tokens under ``model``.

    Returns:
        (log_probs [b, R] float32, entropy [b, R] float32 or None). Positions
        outside the response mask hold garbage; callers mask them.
    """
    device = next(model.parameters()).device
    with autocast(mixed_precision, device):
        out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                    position_ids=mb.position_ids.to(device), logits_to_keep=mb.window + 1,
                    use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    labels = mb.input_ids[:, -mb.window:].to(device)
    log_probs = log_probs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def split_micro_batches(batch: PackedBatch, micro_batch_size: int) -> list[PackedBatch]:
    """Consecutive chunks of at most ``micro_batch_size`` samples (order kept)."""
    n = batch.num_samples
    return [batch.select(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)]


@torch.no_grad()
def compute_log_probs(model, batch: PackedBatch, pad_token_id: int, micro_batch_size: int,
                      temperature: float, mixed_precision: str = "none") -> torch.Tensor:
    """Per-token log-probs of a whole local batch, packed ``[T_total]`` (0 on prompt tokens)."""
    pieces = []
    for chunk in split_micro_batches(batch, micro_batch_size):
        mb = collate(chunk, pad_token_id)
        lp, _ = forward_log_probs(model, mb, temperature, False, mixed_precision)
        pieces.append(unwindow(mb, lp.cpu()))
    if not pieces:
        return torch.zeros(0)
    return torch.cat(pieces)
