"""PackedBatch: packing arithmetic, select/concat/slice, padding round trips, validation."""

from __future__ import annotations

import pytest
import torch

from distflow.data.batch import SAMPLE, TOKEN, FieldSpec, PackedBatch, from_padded

pytestmark = pytest.mark.unit


def small_batch() -> PackedBatch:
    # sample 0: tokens 10 11; sample 1: none; sample 2: tokens 20 21 22
    return PackedBatch(
        seq_lens=torch.tensor([2, 0, 3]),
        token_fields={"input_ids": torch.tensor([10, 11, 20, 21, 22]),
                      "log_probs": torch.tensor([-1.0, -1.5, -2.0, -2.5, -3.0])},
        sample_fields={"rewards": torch.tensor([1.0, 0.0, 0.5]),
                       "span": torch.tensor([[0, 2], [2, 2], [2, 5]])},
    )


def test_sizes_and_offsets():
    batch = small_batch()
    assert batch.num_samples == 3 and batch.num_tokens == 5
    assert batch.cu_seqlens().tolist() == [0, 2, 2, 5]
    assert batch.cu_seqlens().dtype == torch.int32
    # tokens: 5 * (8 + 4) bytes; samples: 3 * (4 + 16) bytes
    assert batch.nbytes == 60 + 60
    assert batch.sample_nbytes() == [2 * 12 + 20, 20, 3 * 12 + 20]


def test_schema_lists_token_then_sample_fields_by_name():
    assert small_batch().field_schema() == (
        FieldSpec("input_ids", TOKEN, torch.int64, ()),
        FieldSpec("log_probs", TOKEN, torch.float32, ()),
        FieldSpec("rewards", SAMPLE, torch.float32, ()),
        FieldSpec("span", SAMPLE, torch.int64, (2,)),
    )
    assert FieldSpec("h", TOKEN, torch.bfloat16, (3, 4)).row_nbytes == 24


def test_select_keeps_the_given_order_and_allows_repeats():
    picked = small_batch().select([2, 0, 2])
    assert picked.seq_lens.tolist() == [3, 2, 3]
    assert picked.token_fields["input_ids"].tolist() == [20, 21, 22, 10, 11, 20, 21, 22]
    assert picked.sample_fields["span"].tolist() == [[2, 5], [0, 2], [2, 5]]
    empty = small_batch().select([])
    assert empty.num_samples == 0 and empty.token_fields["log_probs"].shape == (0,)


def test_row_ranges_merge_adjacent_samples_and_match_a_loop():
    batch = PackedBatch(seq_lens=torch.tensor([3, 0, 1, 4, 2]),
                        token_fields={"t": torch.arange(10)}, sample_fields={"s": torch.arange(5)})
    order = [3, 4, 0, 1, 2, 3]
    # runs 3-4 and 0-1-2-3; token offsets from cu_seqlens [0, 3, 3, 4, 8, 10]
    assert batch.row_ranges(order) == [(3, 5, 4, 10), (0, 4, 0, 8)]
    cu = batch.cu_seqlens(torch.int64).tolist()
    expected = [t for i in order for t in range(cu[i], cu[i + 1])]
    assert batch.gather_field("t", batch.row_ranges(order)).tolist() == expected
    assert batch.gather_field("s", batch.row_ranges(order)).tolist() == order
    with pytest.raises(ValueError, match="sample index 5 is out of range"):
        batch.row_ranges([5])


def test_slice_is_a_view():
    batch = small_batch()
    part = batch.slice(1, 3)
    assert part.token_fields["input_ids"].tolist() == [20, 21, 22]
    assert part.token_fields["input_ids"].data_ptr() == batch.token_fields["input_ids"][2:].data_ptr()
    with pytest.raises(ValueError, match="slice"):
        batch.slice(2, 4)


def test_select_out_of_range_names_the_index():
    with pytest.raises(ValueError, match="sample index -1"):
        small_batch().select([0, -1])


def test_concat_then_select_restores_the_parts():
    batch = small_batch()
    joined = PackedBatch.concat([batch.select([2]), batch.select([0, 1])])
    assert joined.seq_lens.tolist() == [3, 2, 0]
    assert joined.token_fields["input_ids"].tolist() == [20, 21, 22, 10, 11]
    back = joined.select([1, 2, 0])
    for name, value in batch.token_fields.items():
        assert torch.equal(back.token_fields[name], value)


def test_concat_names_the_field_that_differs():
    batch = small_batch()
    other = batch.with_fields(sample={"rewards": batch.sample_fields["rewards"].double()})
    with pytest.raises(ValueError, match=r"batches\[1\]: field 'rewards'"):
        PackedBatch.concat([batch, other])
    with pytest.raises(ValueError, match="at least one batch"):
        PackedBatch.concat([])


def test_with_fields_returns_a_new_batch():
    batch = small_batch()
    more = batch.with_fields(token={"advantages": torch.ones(5)}, sample={"rewards": torch.zeros(3)})
    assert sorted(more.token_fields) == ["advantages", "input_ids", "log_probs"]
    assert more.sample_fields["rewards"].tolist() == [0.0, 0.0, 0.0]
    assert batch.sample_fields["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert "advantages" not in batch.token_fields


def test_to_padded_right_and_left():
    batch = small_batch()
    assert batch.to_padded("input_ids", pad_value=-1).tolist() == [
        [10, 11, -1], [-1, -1, -1], [20, 21, 22]]
    assert batch.to_padded("input_ids", pad_value=0, max_len=4, left_pad=True).tolist() == [
        [0, 0, 10, 11], [0, 0, 0, 0], [0, 20, 21, 22]]


def test_to_padded_matches_a_loop_and_from_padded_inverts_it():
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 7, (9,), generator=gen)
    hidden = torch.randn(int(lens.sum()), 2, generator=gen)
    batch = PackedBatch(seq_lens=lens, token_fields={"hidden": hidden})
    for left_pad in (False, True):
        padded = batch.to_padded("hidden", pad_value=0.0, max_len=8, left_pad=left_pad)
        expected = torch.zeros(9, 8, 2)
        start = 0
        for b, n in enumerate(lens.tolist()):
            cols = slice(8 - n, 8) if left_pad else slice(0, n)
            expected[b, cols] = hidden[start: start + n]
            start += n
        assert torch.equal(padded, expected)
        assert torch.equal(from_padded(padded, lens, left_pad=left_pad), hidden)


def test_padding_errors_name_the_problem():
    batch = small_batch()
    with pytest.raises(ValueError, match="no token field 'rewards'"):
        batch.to_padded("rewards", 0)
    with pytest.raises(ValueError, match="max_len=2 is shorter than the longest sample"):
        batch.to_padded("input_ids", 0, max_len=2)
    with pytest.raises(ValueError, match="exceeds the padded width"):
        from_padded(torch.zeros(2, 2), torch.tensor([1, 3]))


def test_validation_names_the_field():
    lens = torch.tensor([2, 1])
    with pytest.raises(ValueError, match="token field 'input_ids' has first dim 2, expected sum"):
        PackedBatch(lens, token_fields={"input_ids": torch.zeros(2)})
    with pytest.raises(ValueError, match="sample field 'rewards' has first dim 3"):
        PackedBatch(lens, sample_fields={"rewards": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"\['x'\] are both token and sample"):
        PackedBatch(lens, token_fields={"x": torch.zeros(3)}, sample_fields={"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="negative length"):
        PackedBatch(torch.tensor([2, -1]))
    with pytest.raises(ValueError, match="integer tensor"):
        PackedBatch(torch.tensor([2.0, 1.0]))


def test_seq_lens_become_cpu_int64():
    batch = PackedBatch(torch.tensor([1, 2], dtype=torch.int32), token_fields={"x": torch.zeros(3)})
    assert batch.seq_lens.dtype == torch.int64 and batch.seq_lens.device.type == "cpu"
