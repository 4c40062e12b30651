"""FlexAttention on shared-prompt rows: a few row widths over many micro-batches, one block mask
per micro-batch however many passes run it, and the same log-probs as unpadded rows.

Run eagerly on CPU (``eager_flex``): the widths the attention kernel is called with are the
shapes a CUDA run would compile for.
"""

from __future__ import annotations

import random

import pytest
import torch

from distflow.engines import flex_masks, model_ops
from distflow import models
from test_shared_prefix import MIXED, PAD, VOCAB, eager_flex, make_batch  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def model():
    """The tiny Llama; the flex forward sets its own attention implementation."""
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(autouse=True)
def no_cached_masks():
    flex_masks.forget_block_masks()
    yield
    flex_masks.forget_block_masks()


def test_widths_are_tile_multiples_growing_by_half_or_double():
    widths = [0, 1, 128, 129, 256, 257, 384, 385, 512, 513, 768, 769, 1024, 1025, 1537, 3000]
    assert [flex_masks.bucketed_width(w) for w in widths] == \
        [0, 128, 128, 256, 256, 384, 384, 512, 512, 768, 768, 1024, 1024, 1536, 2048, 3072]


def _random_groups(rng: random.Random, num_groups: int, seed: int):
    """Samples of ``num_groups`` GRPO groups: 2-4 responses each, prompts 5-60, responses 1-30 tokens."""
    samples = []
    for group in range(num_groups):
        prompt = rng.randint(5, 60)
        samples += [(group, prompt, rng.randint(1, 30), 0) for _ in range(rng.randint(2, 4))]
    return make_batch(samples, seed=seed)


@pytest.fixture
def flex_widths(monkeypatch, eager_flex):  # noqa: F811
    """Row widths FlexAttention is called with (one entry per attention call)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    seen = []

    def recording(query, *args, **kwargs):
        seen.append(query.shape[-2])
        return flex_attention(query, *args, **kwargs)

    monkeypatch.setattr(hf_flex.WrappedFlexAttention, "__call__", lambda self: recording)
    return seen


def test_many_micro_batches_run_few_widths(model, flex_widths):
    rng = random.Random(0)
    raw = set()
    with torch.no_grad():
        for i in range(12):
            mb = model_ops.collate(_random_groups(rng, 2, seed=i), PAD, share_prompt_prefix=True)
            raw.add(mb.prefix_rows.segment.shape[1])
            model_ops.forward_log_probs(model, mb, 1.0, False, shared_attention="flex")
    assert len(raw) >= 10  # without buckets nearly every micro-batch is a new shape
    # Rows here are at most 60 + 4 x 30 = 180 tokens wide: 128 or 256.
    assert set(flex_widths) <= {128, 256}


def test_padded_rows_give_the_unpadded_log_probs(model, eager_flex, monkeypatch):  # noqa: F811
    shared = model_ops.collate(make_batch(MIXED, seed=4), PAD, share_prompt_prefix=True)
    assert shared.prefix_rows.segment.shape[1] == 18  # padded to 128
    with torch.no_grad():
        lp, ent = model_ops.forward_log_probs(model, shared, 1.0, True, shared_attention="flex")
        monkeypatch.setattr(flex_masks, "bucketed_width", lambda width: width)
        lp_raw, ent_raw = model_ops.forward_log_probs(model, shared, 1.0, True, shared_attention="flex")
    mask = shared.response_mask.bool()
    torch.testing.assert_close(lp[mask], lp_raw[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[mask], ent_raw[mask], rtol=0, atol=1e-6)


def test_each_micro_batch_builds_its_block_mask_once(model, eager_flex, monkeypatch):  # noqa: F811
    import torch.nn.attention.flex_attention as flex

    built = []
    original = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: built.append(a[1:]) or original(*a, **k))
    batch = _random_groups(random.Random(1), 6, seed=1)
    chunks = model_ops.split_micro_batches(batch, 6)
    with torch.no_grad():
        for _ in range(3):  # reference, old policy, update: each pass collates its rows anew
            for chunk in chunks:
                mb = model_ops.collate(chunk, PAD, share_prompt_prefix=True)
                model_ops.forward_log_probs(model, mb, 1.0, False, shared_attention="flex")
        assert len(built) == len(chunks) >= 3
        flex_masks.forget_block_masks()  # a new step
        model_ops.forward_log_probs(model, model_ops.collate(chunks[0], PAD, True), 1.0, False,
                                    shared_attention="flex")
    assert len(built) == len(chunks) + 1
