"""Shared prompt prefixes (Prefix Grouper, arXiv 2506.05433) give the per-sample pass's results.

A tiny random Llama in float32 runs micro-batches both ways: left-padded, one
row per sample, and ``collate(..., share_prompt_prefix=True)``, one row per
prompt. Log-probs, entropies and the gradients of a token-mean loss must agree
to float rounding, with prompts of different lengths, responses of different
lengths, a group split over rows and micro-batches, a singleton group, and two
samples whose ``group_index`` matches but whose prompts differ (not shared).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest
import torch
from packaging.version import Version

from distflow import models
from distflow.data.batch import PackedBatch
from distflow.engines import model_ops

# The feature is optional (the code falls back), so older transformers skip rather than fail.
pytestmark = [pytest.mark.unit, pytest.mark.skipif(
    Version(metadata.version("transformers")) < Version("5.21"),
    reason="shared prompt prefixes need transformers >= 5.21 (a boolean `logits_to_keep`); "
           "older ones run the per-sample path")]

VOCAB = 300
PAD = 0


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=request.param)


def make_batch(samples, seed=0):
    """``samples``: (group_index, prompt_len, response_len, prompt_variant); samples with the
    same (group_index, prompt_len, prompt_variant) get the same prompt tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = {}
    ids, masks = [], []
    for group, p, r, variant in samples:
        prompt = prompts.setdefault((group, p, variant), torch.randint(3, VOCAB, (p,), generator=gen))
        ids.append(torch.cat([prompt, torch.randint(3, VOCAB, (r,), generator=gen)]))
        masks.append(torch.tensor([0] * p + [1] * r, dtype=torch.int8))
    column = lambda k: torch.tensor([s[k] for s in samples])  # noqa: E731
    return PackedBatch(column(1) + column(2), {"input_ids": torch.cat(ids), "response_mask": torch.cat(masks)},
                       {"group_index": column(0), "prompt_len": column(1), "response_len": column(2)})


# Group 7 (prompt 9) has three samples, group 3 (prompt 4) two, group 5 one; the last sample
# says group 7 but has another prompt of the same length.
MIXED = [(7, 9, 5, 0), (3, 4, 2, 0), (7, 9, 1, 0), (5, 6, 7, 0), (3, 4, 6, 0), (7, 9, 3, 0), (7, 9, 4, 1)]


def test_rows_group_samples_by_group_and_identical_prompt():
    batch = make_batch(MIXED)
    rows = model_ops.collate(batch, PAD, share_prompt_prefix=True).prefix_rows
    # Rows in order of first sample: group 7 (samples 0, 2, 5), group 3 (1, 4), group 5 (3), group 7's other prompt (6).
    lengths = [9 + 5 + 1 + 3, 4 + 2 + 6, 6 + 7, 9 + 4]
    assert rows.input_ids.shape == (4, max(lengths))
    assert (rows.segment >= 0).sum(1).tolist() == lengths
    ids, offsets = batch.token_fields["input_ids"], batch.token_offsets
    assert torch.equal(rows.input_ids[0, :18], torch.cat([ids[offsets[0]:offsets[1]], ids[offsets[2] + 9:offsets[3]],
                                                          ids[offsets[5] + 9:offsets[6]]]))
    assert torch.equal(rows.input_ids[3, :13], ids[offsets[6]:offsets[7]])
    assert (rows.input_ids[1:, 13:] == PAD).all()
    # Responses continue the prompt's positions; each response's last token predicts nothing.
    assert rows.position_ids[0, :18].tolist() == [*range(9), *range(9, 14), 9, *range(9, 12)]
    assert rows.keep[0, :18].tolist() == [False] * 8 + [True] + [True] * 4 + [False] + [False] + [True] * 2 + [False]
    assert rows.labels.numel() == int(batch.sample_fields["response_len"].sum())


def test_attention_sees_the_prompt_and_the_own_response_only():
    rows = model_ops.collate(make_batch([(0, 3, 2, 0), (0, 3, 2, 0)]), PAD, share_prompt_prefix=True).prefix_rows
    allowed = rows.attention_allowed(torch.device("cpu"))[0].int().tolist()
    # Columns: prompt p0 p1 p2, response one a0 a1, response two b0 b1.
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1],
    ]


def test_nothing_to_share_keeps_the_per_sample_layout():
    distinct = make_batch([(0, 4, 3, 0), (1, 4, 3, 0), (0, 4, 2, 1)])
    assert model_ops.collate(distinct, PAD, share_prompt_prefix=True).prefix_rows is None
    shared = make_batch([(0, 4, 3, 0), (0, 4, 2, 0)])
    no_groups = PackedBatch(shared.seq_lens, shared.token_fields,
                            {k: v for k, v in shared.sample_fields.items() if k != "group_index"})
    assert model_ops.collate(no_groups, PAD, share_prompt_prefix=True).prefix_rows is None
    assert model_ops.collate(shared, PAD).prefix_rows is None


def test_inconsistent_lengths_are_refused():
    batch = make_batch([(0, 4, 3, 0), (0, 4, 2, 0)])
    wrong = batch.with_fields(sample={"prompt_len": torch.tensor([3, 4])})
    with pytest.raises(ValueError, match="sample 0: prompt_len 3 \\+ response_len 3 must be its length 7"):
        model_ops.collate(wrong, PAD, share_prompt_prefix=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_equal_the_per_sample_pass(model, temperature):
    batch = make_batch(MIXED)
    plain = model_ops.collate(batch, PAD)
    shared = model_ops.collate(batch, PAD, share_prompt_prefix=True)
    assert shared.prefix_rows is not None and torch.equal(shared.response_mask, plain.response_mask)
    with torch.no_grad():
        lp, ent = model_ops.forward_log_probs(model, plain, temperature, True)
        lp_shared, ent_shared = model_ops.forward_log_probs(model, shared, temperature, True)
    mask = plain.response_mask.bool()
    torch.testing.assert_close(lp_shared[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_shared[mask], ent[mask], rtol=0, atol=1e-5)
    assert (lp_shared[~mask] == 0).all() and (ent_shared[~mask] == 0).all()


def test_a_group_split_over_micro_batches(model):
    # Micro-batches of 3: [g7, g3, g7], [g5, g3, g7], [g7'] -- groups 7 and 3 span two of them.
    batch = make_batch(MIXED, seed=1)
    plain = model_ops.compute_log_probs(model, batch, PAD, 3, 1.0)
    shared = model_ops.compute_log_probs(model, batch, PAD, 3, 1.0, share_prompt_prefix=True)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def test_gradients_of_a_token_mean_loss_are_equal(model):
    batch = make_batch(MIXED, seed=2)

    def grads(share):
        mb = model_ops.collate(batch, PAD, share_prompt_prefix=share)
        model.zero_grad(set_to_none=True)
        lp, ent = model_ops.forward_log_probs(model, mb, 1.0, True)
        weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)  # advantage-like, varies per token
        loss = ((weights * lp + 0.01 * ent) * mb.response_mask).sum() / mb.response_mask.sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, shared = grads(False), grads(True)
    assert plain.keys() == shared.keys()
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], rtol=1e-4, atol=1e-7, msg=name)


def _cached_smollm2():
    """The converted SmolLM2 directory when it is already in the model cache (never converts)."""
    if importlib.util.find_spec(models.SMOLLM2_PACKAGE) is None:
        return None
    from distflow.models import model_cache_dir

    out = models.gguf_cache_dir(models.find_gguf(models.SMOLLM2_PACKAGE), model_cache_dir())
    return out if (out / "config.json").is_file() else None


def test_smollm2_log_probs_equal_the_per_sample_pass():
    local = _cached_smollm2()
    if local is None:
        pytest.skip("SmolLM2 is not converted in the model cache")
    model = models.load_causal_lm(local)
    batch = make_batch([(0, 24, 6, 0), (0, 24, 3, 0), (1, 11, 5, 0), (0, 24, 4, 0)], seed=3)
    with torch.no_grad():
        lp, _ = model_ops.forward_log_probs(model, model_ops.collate(batch, PAD), 1.0, False)
        shared = model_ops.collate(batch, PAD, share_prompt_prefix=True)
        lp_shared, _ = model_ops.forward_log_probs(model, shared, 1.0, False)
    mask = shared.response_mask.bool()
    torch.testing.assert_close(lp_shared[mask], lp[mask], rtol=1e-5, atol=1e-5)  # 30 layers: |lp| up to ~25


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention without inductor: transformers compiles it on first use, which on
    CPU takes minutes per shape; eager gives the same numbers on these tiny rows."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(hf_flex.WrappedFlexAttention, "__call__", lambda self: flex_attention)


def test_block_mask_allows_exactly_the_dense_mask(eager_flex):
    rows = model_ops.collate(make_batch(MIXED), PAD, share_prompt_prefix=True).prefix_rows
    allowed = rows.attention_allowed(torch.device("cpu"))
    block = rows.block_mask(torch.device("cpu"))
    g, width = rows.segment.shape
    assert block.shape == (g, 1, width, width)
    q = torch.arange(width)
    for b in range(g):
        from_mask_mod = block.mask_mod(torch.tensor(b), torch.tensor(0), q[:, None], q[None, :])
        assert torch.equal(from_mask_mod, allowed[b])


def test_flex_attention_log_probs_and_entropy_equal_the_per_sample_pass(model, eager_flex):
    """Tolerance: 1e-5 absolute (|lp| < ~6 on the 300-token vocabulary), as for sdpa. Forward
    only: FlexAttention has no backward on CPU; gpu_check compares gradients on CUDA."""
    batch = make_batch(MIXED, seed=4)
    plain = model_ops.collate(batch, PAD)
    shared = model_ops.collate(batch, PAD, share_prompt_prefix=True)
    with torch.no_grad():
        lp, ent = model_ops.forward_log_probs(model, plain, 1.0, True)
        lp_flex, ent_flex = model_ops.forward_log_probs(model, shared, 1.0, True, shared_attention="flex")
    assert model.config._attn_implementation in ("sdpa", "eager")  # restored after the forward
    mask = plain.response_mask.bool()
    torch.testing.assert_close(lp_flex[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_flex[mask], ent[mask], rtol=0, atol=1e-5)


def test_shared_attention_defaults_to_flex_on_cuda_and_dense_on_cpu(model):
    pick = model_ops.shared_attention_backend
    assert pick(model, torch.device("cuda", 0)) == "flex"
    assert pick(model, torch.device("cpu")) == "dense"
    assert pick(model, torch.device("cpu"), "flex") == "flex"
    with pytest.raises(ValueError, match="choose one of"):
        pick(model, torch.device("cpu"), "packed")
