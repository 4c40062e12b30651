"""Rollout with Hugging Face `generate` (CPU and GPU).

Each rollout dp rank generates the groups of the prompts it read itself; the
``n`` responses of a prompt stay together on that rank, so group statistics
(GRPO) need no communication. The output is a ``PackedBatch`` whose token
fields span prompt + response:

- ``input_ids``      [T_total] int64
- ``response_mask``  [T_total] int8, 1 on generated tokens (EOS included)

and whose sample fields are ``prompt_len``, ``response_len``, ``group_index``
(global prompt index in the step) [B] int64.

Sampling is seeded per (seed, step, dp rank), so a run is reproducible on the
same layout; a different dp size samples different responses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distflow.data.batch import PackedBatch


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    micro_batch_size: int


def render_prompts(tokenizer, records, max_prompt_length: int, system_prompt: str | None = None) -> list[list[int]]:
    """Chat-template each record's messages; keep the last ``max_prompt_length`` tokens.

    ``system_prompt`` replaces the record's own system message, if any.
    """
    out = []
    for rec in records:
        messages = list(rec.messages)
        if system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}] + [
                m for m in messages if m.get("role") != "system"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids)[-max_prompt_length:])
    return out


def _trim_response(tokens: torch.Tensor, eos_ids: set[int], pad_id: int) -> list[int]:
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t in eos_ids:
            break
    while out and out[-1] == pad_id and pad_id not in eos_ids:
        out.pop()
    return out


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], group_index: list[int],
             params: SamplingParams, seed: int, device: torch.device) -> PackedBatch:
    """Sample ``params.n`` responses per prompt.

    Args:
        prompts: token ids per prompt (this rank's).
        group_index: the global index of each prompt in the step.
        seed: seeds the sampling RNG for this call.
    Returns:
        PackedBatch of len(prompts) * n samples, the n of a prompt adjacent.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    pad_id = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    expanded = [(p, g) for p, g in zip(prompts, group_index) for _ in range(params.n)]
    seqs, meta = [], []
    for start in range(0, len(expanded), params.micro_batch_size):
        chunk = expanded[start:start + params.micro_batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad_id, eos_token_id=list(eos_ids))
        if params.temperature > 0:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or None)
        else:
            kwargs.update(do_sample=False)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs).cpu()
        for i, (p, g) in enumerate(chunk):
            resp = _trim_response(out[i, width:], eos_ids, pad_id)
            seqs.append((p, resp))
            meta.append(g)
    return _pack(seqs, meta)


def _pack(seqs: list[tuple[list[int], list[int]]], groups: list[int]) -> PackedBatch:
    lens = torch.tensor([len(p) + len(r) for p, r in seqs], dtype=torch.long)
    ids = torch.tensor([t for p, r in seqs for t in p + r], dtype=torch.long)
    rmask = torch.tensor([m for p, r in seqs for m in [0] * len(p) + [1] * len(r)], dtype=torch.int8)
    return PackedBatch(
        seq_lens=lens,
        token_fields={"input_ids": ids, "response_mask": rmask},
        sample_fields={
            "prompt_len": torch.tensor([len(p) for p, _ in seqs], dtype=torch.long),
            "response_len": torch.tensor([len(r) for _, r in seqs], dtype=torch.long),
            "group_index": torch.tensor(groups, dtype=torch.long),
        },
    )


def response_texts(tokenizer, batch: PackedBatch) -> list[str]:
    """Decoded responses (special tokens dropped), in batch order."""
    ids = batch.token_fields["input_ids"]
    mask = batch.token_fields["response_mask"].bool()
    offsets = batch.cu_seqlens(dtype=torch.long).tolist()
    out = []
    for b in range(batch.num_samples):
        seg = ids[offsets[b]:offsets[b + 1]][mask[offsets[b]:offsets[b + 1]]]
        out.append(tokenizer.decode(seg.tolist(), skip_special_tokens=True))
    return out
