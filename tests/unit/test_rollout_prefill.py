"""Shared rollout prefill (``rollout.sharePrefill``) samples what the per-sample prefill samples.

A tiny random Llama in float32 generates n = 3 responses for prompts of
different lengths (1 to 11 tokens, so left padding and a prompt with an empty
prefix are exercised), once prefilling every sample and once prefilling each
prompt once and repeating its KV cache. Both run the same chunks (whole groups)
and draw the same random numbers, and the logits differ only by float rounding
(the last prompt token is a one-token step on the cache instead of part of the
full-prompt pass), so on CPU in float32 the responses are token-identical,
greedy and sampled alike.
"""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from distflow import models
from distflow.engines import rollout
from distflow.engines.rollout import SamplingParams, generate

# The feature is optional (the code falls back), so older transformers skip rather than fail.
pytestmark = [pytest.mark.unit, pytest.mark.skipif(
    Version(metadata.version("transformers")) < Version("5.24"),
    reason="the shared prefill needs transformers >= 5.24 (the `cache` kwarg, no `cache_position`); "
           "older ones prefill per sample")]

VOCAB = 300
PAD, BOS, EOS = 0, 1, 2
N = 3
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=request.param).eval()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 1, 8, 3)]


def tokenizer(eos=EOS):
    return SimpleNamespace(pad_token_id=PAD, eos_token_id=eos)


def run(model, prompts, share, temperature=0.0, micro_batch_size=6, eos=EOS, max_new_tokens=12, seed=123):
    params = SamplingParams(N, temperature, 1.0, 0, max_new_tokens, micro_batch_size, share_prefill=share)
    return generate(model, tokenizer(eos), prompts, [10 + i for i in range(len(prompts))], params, seed, CPU)


def responses(batch):
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["response_mask"].bool()
    offsets = batch.cu_seqlens(dtype=torch.long).tolist()
    return [ids[a:b][mask[a:b]].tolist() for a, b in zip(offsets, offsets[1:])]


def assert_same_batch(a, b):
    assert torch.equal(a.seq_lens, b.seq_lens)
    assert a.token_fields.keys() == b.token_fields.keys() and a.sample_fields.keys() == b.sample_fields.keys()
    for k in a.token_fields:
        assert torch.equal(a.token_fields[k], b.token_fields[k]), k
    for k in a.sample_fields:
        assert torch.equal(a.sample_fields[k], b.sample_fields[k]), k


def test_group_chunks_hold_whole_groups():
    assert rollout._group_chunks(5, 3, 6) == [[(0, 3), (1, 3)], [(2, 3), (3, 3)], [(4, 3)]]
    assert rollout._group_chunks(3, 3, 7) == [[(0, 3), (1, 3)], [(2, 3)]]
    assert rollout._group_chunks(2, 3, 2) == [[(0, 2)], [(0, 1)], [(1, 2)], [(1, 1)]]
    assert rollout._group_chunks(2, 1, 64) == [[(0, 1), (1, 1)]]


def test_tiny_llama_supports_shared_prefill(model):
    assert rollout._supports_shared_prefill(model)


def test_prompt_is_prefilled_once_per_group(model, prompts):
    """The first forward is the distinct prompts less their last token; generate then starts
    with one token per sample."""
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        run(model, prompts[:2], share=True, max_new_tokens=3)
    finally:
        hook.remove()
    assert shapes == [(2, 10), (2 * N, 1), (2 * N, 1), (2 * N, 1)]


@pytest.mark.parametrize("micro_batch_size", [7, 2])  # 2 groups (1 seat spare), a group split over calls
def test_greedy_responses_are_identical(model, prompts, micro_batch_size):
    shared = run(model, prompts, share=True, micro_batch_size=micro_batch_size)
    unshared = run(model, prompts, share=False, micro_batch_size=micro_batch_size)
    assert_same_batch(shared, unshared)
    assert unshared.num_samples == len(prompts) * N
    assert unshared.sample_fields["group_index"].tolist() == [10 + i for i in range(len(prompts)) for _ in range(N)]
    assert unshared.sample_fields["prompt_len"].tolist() == [len(p) for p in prompts for _ in range(N)]


@pytest.mark.parametrize("micro_batch_size", [6, 2])
def test_sampled_responses_are_identical_for_a_seed(model, prompts, micro_batch_size):
    shared = run(model, prompts, share=True, temperature=1.0, micro_batch_size=micro_batch_size)
    unshared = run(model, prompts, share=False, temperature=1.0, micro_batch_size=micro_batch_size)
    assert_same_batch(shared, unshared)
    texts = responses(shared)
    assert any(texts[g * N] != texts[g * N + 1] for g in range(len(prompts)))  # really sampled
    other = run(model, prompts, share=True, temperature=1.0, micro_batch_size=micro_batch_size, seed=124)
    assert responses(other) != texts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_stops_and_trims_responses_the_same_way(model, prompts, temperature):
    """EOS ids picked from the free-running responses: some samples stop early, EOS kept, no pads.

    The model's own EOS (its generation config's) stops responses too, so it is in the set.
    """
    free = responses(run(model, prompts, share=False, temperature=temperature))
    eos = sorted({free[0][3], free[N][1], free[2 * N + 2][5], EOS} - {PAD})
    shared = run(model, prompts, share=True, temperature=temperature, eos=eos)
    unshared = run(model, prompts, share=False, temperature=temperature, eos=eos)
    assert_same_batch(shared, unshared)
    lens = unshared.sample_fields["response_len"].tolist()
    assert min(lens) < 12 and max(lens) == 12
    for resp in responses(unshared):
        assert all(t not in eos for t in resp[:-1])
        assert len(resp) == 12 or resp[-1] in eos
        assert PAD not in resp


def test_sliding_window_cache_falls_back_to_per_sample_prefill(prompts):
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert not rollout._supports_shared_prefill(model)
    assert_same_batch(run(model, prompts, share=True), run(model, prompts, share=False))
