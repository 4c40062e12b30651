"""Rollout sampling is seeded per global sample, not per rank or per call.

Response ``j`` of the prompt with global index ``g`` draws its tokens from
uniforms fixed by ``(step seed, g, j, position)``, so the same prompts sampled
on one rank, or split over two ranks, or in smaller chunks (a group split over
calls), give the same responses: a run resumed on another world size samples
what the old size would have.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distflow.engines.rollout import SamplingParams, _PerSampleSampler, generate, sample_uniforms
from tests.unit.test_rollout_prefill import EOS, N, PAD, model, one_thread, prompts  # noqa: F401 (fixtures)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def sampled(model, prompts, groups, micro_batch_size, seed=7, top_k=0) -> dict[tuple[int, int], list[int]]:
    """``{(global prompt index, sample index): response tokens}`` of one generate call."""
    params = SamplingParams(N, 1.0, 1.0, top_k, 10, micro_batch_size, share_prefill=False)
    batch = generate(model, TOKENIZER, prompts, groups, params, seed, CPU)
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["response_mask"].bool()
    offsets = batch.cu_seqlens(dtype=torch.long).tolist()
    out, seen = {}, {}
    for b, group in enumerate(batch.sample_fields["group_index"].tolist()):
        j = seen[group] = seen.get(group, -1) + 1
        out[(group, j)] = ids[offsets[b]:offsets[b + 1]][mask[offsets[b]:offsets[b + 1]]].tolist()
    return out


def test_a_response_is_the_same_on_any_rank_and_in_any_chunk(model, prompts):
    groups = [40 + i for i in range(len(prompts))]
    one_rank = sampled(model, prompts, groups, micro_batch_size=15)
    two_ranks = {**sampled(model, prompts[:2], groups[:2], micro_batch_size=2),  # groups split over calls
                 **sampled(model, prompts[2:], groups[2:], micro_batch_size=6)}
    assert two_ranks == one_rank
    assert len(one_rank) == len(prompts) * N
    assert any(one_rank[(g, 0)] != one_rank[(g, 1)] for g in groups)  # really sampled
    assert sampled(model, prompts, groups, micro_batch_size=15, seed=8) != one_rank
    shifted = sampled(model, prompts, [g + 1 for g in groups], micro_batch_size=15)
    assert shifted[(41, 0)] != one_rank[(41, 0)]  # same prompt text, another global index


def test_top_k_one_samples_the_greedy_response(model, prompts):
    params = SamplingParams(N, 0.0, 1.0, 0, 10, 15, share_prefill=False)
    greedy = generate(model, TOKENIZER, prompts, list(range(len(prompts))), params, 0, CPU)
    top1 = sampled(model, prompts, list(range(len(prompts))), micro_batch_size=15, top_k=1)
    offsets = greedy.cu_seqlens(dtype=torch.long).tolist()
    mask = greedy.token_fields["response_mask"].bool()
    first = greedy.token_fields["input_ids"][offsets[0]:offsets[1]][mask[offsets[0]:offsets[1]]].tolist()
    assert top1[(0, 0)] == top1[(0, 2)] == first


def test_uniforms_are_a_pure_function_of_seed_and_position():
    seeds = np.arange(20000, dtype=np.uint64) * np.uint64(7919)
    u = sample_uniforms(seeds, 3)
    assert np.array_equal(u, sample_uniforms(seeds, 3))
    assert np.array_equal(u[5:9], sample_uniforms(seeds[5:9], 3))
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.median(u) - 0.5) < 0.01
    assert np.mean(u == sample_uniforms(seeds, 4)) == 0.0 and len(np.unique(u)) == len(u)


def test_the_sampler_draws_tokens_with_their_softmax_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    rows = 20000
    scores = probs.log().expand(rows, -1).clone()
    sampler = _PerSampleSampler(list(range(rows)), prompt_width=2, params=SamplingParams(1, 1.0, 1.0, 0, 4, 1))
    out = sampler(torch.zeros(rows, 2, dtype=torch.long), scores)
    assert torch.equal(torch.isfinite(out).sum(dim=1), torch.ones(rows, dtype=torch.long))  # one token per row
    counts = torch.bincount(out.argmax(dim=1), minlength=4).double() / rows
    assert torch.allclose(counts, probs.double(), atol=0.015) and counts[3] == 0.0
    top2 = _PerSampleSampler(list(range(rows)), 2, SamplingParams(1, 1.0, 1.0, 2, 4, 1))
    counts = torch.bincount(top2(torch.zeros(rows, 2, dtype=torch.long), scores).argmax(dim=1), minlength=4)
    assert counts[2] == counts[3] == 0 and abs(counts[0] / rows - 0.5 / 0.8) < 0.015
