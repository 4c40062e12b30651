"""Where the model's own tokens are: a response may interleave them with tool tokens.

A multi-turn sample is prompt, model turn, tool output (and the chat template
around it), model turn, ...; ``response_mask`` is 1 only on the tokens the
model sampled, so mask-0 tokens can sit between mask-1 runs. A single-turn
response is one mask-1 run after the prompt, and every function here then
gives what the old contiguous arithmetic gave (``prompt_len + response_len - 1``,
``response_len``).

An outcome (score, overlong penalty) belongs on the model's last token, the
action it rewards; a sample without model tokens (an empty response) keeps it
on its last token, as single-turn always did.
"""

from __future__ import annotations

import torch

from distflow.data.batch import PackedBatch


def _sample_of_token(batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """[T_total] int64: the sample each packed token belongs to."""
    return torch.repeat_interleave(torch.arange(batch.num_samples, device=device), batch.seq_lens.to(device))


def model_token_counts(batch: PackedBatch) -> torch.Tensor:
    """[B] int64: the model's own tokens per sample (the sum of its ``response_mask``), on the fields' device."""
    mask = batch.token_fields["response_mask"]
    counts = torch.zeros(batch.num_samples, dtype=torch.long, device=mask.device)
    return counts.index_add_(0, _sample_of_token(batch, mask.device), mask.long())


def last_model_token(batch: PackedBatch) -> torch.Tensor:
    """[B] int64 packed index (into ``[T_total]``) of each sample's last ``response_mask`` 1 token.

    A sample with no such token gets its last token.
    """
    mask = batch.token_fields["response_mask"].bool()
    ends = batch.cu_seqlens(dtype=torch.long)[1:]
    positions = torch.arange(batch.num_tokens, device=mask.device)
    last = torch.full((batch.num_samples,), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(0, _sample_of_token(batch, mask.device), torch.where(mask, positions, -1),
                               reduce="amax")
    return torch.where(last >= 0, last, ends - 1)


def last_model_column(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64 column of each row's last 1 in ``response_mask`` [B, T]; T - 1 for a row of zeros.

    In a left-padded response window (``model_ops.window_field``) T - 1 is each sample's last token.
    """
    columns = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask.bool(), columns, -1).amax(dim=-1)
    return torch.where(last >= 0, last, response_mask.shape[-1] - 1)
