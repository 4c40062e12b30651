"""Token-budget micro-batches (verl's dynamic batch size): same chunks by hand, same update.

The actor's loss is normalised by global token/sequence counts, so cutting a
rank's samples into micro-batches by tokens instead of by count must give the
same loss and the same step (float64 tiny model: equal to 1e-12).
"""

from __future__ import annotations

import pytest
import torch

from distflow import models
from distflow.data.batch import PackedBatch
from distflow.engines import model_ops
from distflow.engines.actor import Actor
from distflow.metrics import StepMetrics
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

VOCAB = 300


def make_batch(prompt_lens, response_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(prompt_lens) + torch.tensor(response_lens)
    mask = torch.cat([torch.tensor([0] * p + [1] * r, dtype=torch.int8) for p, r in zip(prompt_lens, response_lens)])
    adv = torch.randn(int(lens.sum()), generator=gen, dtype=torch.float64) * mask
    return PackedBatch(lens, {"input_ids": torch.randint(3, VOCAB, (int(lens.sum()),), generator=gen),
                              "response_mask": mask, "advantages": adv},
                       {"prompt_len": torch.tensor(prompt_lens), "response_len": torch.tensor(response_lens)})


def test_chunks_are_the_longest_runs_whose_padded_forward_fits_the_budget():
    batch = make_batch([2, 2, 2, 2, 2, 2], [3, 1, 6, 1, 1, 12])  # lengths 5 3 8 3 3 14
    chunks = model_ops.split_micro_batches(batch, micro_batch_size=1, max_tokens=16)
    # [5, 3]: 2 x 5 = 10; + 8 -> 3 x 8 = 24 > 16. [8]: + 3 -> 2 x 8 = 16 fits, + 3 -> 24.
    # [3]: + 14 -> 28. [14] alone (a sequence longer than the budget would go alone too).
    assert [c.seq_lens.tolist() for c in chunks] == [[5, 3], [8, 3], [3], [14]]
    assert [c.seq_lens.tolist() for c in model_ops.split_micro_batches(batch, 4)] == [[5, 3, 8, 3], [3, 14]]
    assert [c.seq_lens.tolist() for c in model_ops.split_micro_batches(batch, 4, max_tokens=1)] == \
        [[n] for n in [5, 3, 8, 3, 3, 14]]


def _update(budget: dict, batch: PackedBatch) -> tuple[dict, dict]:
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2},
                       "actor": {"lr": 1e-3, **budget},
                       "algorithm": {"useKlLoss": False, "entropyCoeff": 0.01}})
    actor = Actor.build(spec, model, pad_token_id=0, dp_size=1, device=torch.device("cpu"))
    metrics = StepMetrics()
    actor.update(batch, metrics)
    return dict(model.named_parameters()), metrics.reduce(torch.device("cpu"))


def test_token_budget_takes_the_same_step_as_fixed_count_micro_batches():
    batch = make_batch([3, 5, 2, 4, 3], [4, 2, 7, 1, 5])  # lengths 7 7 9 5 8
    fixed_params, fixed_metrics = _update({"microBatchSize": 2}, batch)
    budget_params, budget_metrics = _update({"microBatchSize": 2, "maxTokensPerMicroBatch": 15}, batch)
    assert [c.num_samples for c in model_ops.split_micro_batches(batch, 2, 15)] == [2, 1, 1, 1]
    for name, param in fixed_params.items():
        torch.testing.assert_close(budget_params[name], param, rtol=0, atol=1e-12)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert budget_metrics[key] == pytest.approx(fixed_metrics[key], rel=1e-12), key


def test_a_rank_with_fewer_chunks_cuts_its_largest_finer_then_pads():
    batch = make_batch([2, 2, 2, 2], [6, 6, 7, 7])  # lengths 8 8 9 9
    chunks = model_ops.split_micro_batches(batch, 8, max_tokens=20)
    assert [c.seq_lens.tolist() for c in chunks] == [[8, 8], [9, 9]]
    # [9, 9] pads to 2 x 9 = 18 tokens, [8, 8] to 16: the larger is halved first.
    lens = lambda count: [c.seq_lens.tolist() for c in model_ops.fill_micro_batches(batch, chunks, count)]  # noqa: E731
    assert lens(3) == [[8, 8], [9], [9]]
    assert lens(6) == [[8], [8], [9], [9], [], []]
    with pytest.raises(ValueError, match="cannot make 2 micro-batches into 1"):
        model_ops.fill_micro_batches(batch, chunks, 1)


def test_an_empty_micro_batch_is_a_two_pad_token_forward_that_trains_nothing():
    mb = model_ops.collate(make_batch([2], [3]).select([]), pad_token_id=0)
    assert mb.input_ids.tolist() == [[0, 0]] and mb.position_ids.tolist() == [[0, 1]]
    assert mb.response_mask.tolist() == [[0.0]]


def test_each_micro_batch_comes_with_its_metadata_copied_to_the_host():
    batch = make_batch([2, 3, 2, 4], [6, 5, 7, 3])  # lengths 8 8 9 7
    pairs = model_ops.dp_micro_batches(batch, 8, max_tokens=20, share_prompt_prefix=True)
    assert [chunk.seq_lens.tolist() for chunk, _ in pairs] == [[8, 8], [9, 7]]
    for chunk, host in pairs:
        assert torch.equal(host.seq_lens, chunk.seq_lens)
        assert torch.equal(host.token_fields["input_ids"], chunk.token_fields["input_ids"])
        for name in ("prompt_len", "response_len"):
            assert torch.equal(host.sample_fields[name], chunk.sample_fields[name])
    assert "input_ids" not in model_ops.dp_micro_batches(batch, 8)[0][1].token_fields
