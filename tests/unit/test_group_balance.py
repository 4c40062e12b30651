"""Balancing whole prompt groups when the actor shares prompt prefixes.

Hand-checked: four groups of two samples, prompt lengths 40/10/10/40, all
responses 5 tokens. A group's cost is its prompt once plus its responses
(40 + 10 = 50, or 10 + 10 = 20). Held as [g0, g1] on rank 0 and [g2, g3] on
rank 1 (loads 70 / 70) the layout is already balanced and nothing moves; held
as [g0, g3] / [g1, g2] (100 / 40) the best split is 70 / 70, one light and one
heavy group per rank.
"""

import pytest
import torch

from distflow.coordinator import DataCoordinator
from distflow.data.batch import PackedBatch
from distflow.data.counters import TransferCounters
from distflow.planner import build_plan
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _coordinator(share=True):
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                       "rollout": {"n": 2}, "actor": {"sharePromptPrefix": share},
                       "cluster": {"numNodes": 2}})
    return DataCoordinator(spec, build_plan(spec), 0, TransferCounters())


def _batch(prompt_lens, groups, response_len=5):
    lens = [p + response_len for p in prompt_lens]
    total = sum(lens)
    return PackedBatch(
        seq_lens=torch.tensor(lens),
        token_fields={"input_ids": torch.zeros(total, dtype=torch.long),
                      "response_mask": torch.zeros(total, dtype=torch.int8)},
        sample_fields={"prompt_len": torch.tensor(prompt_lens), "response_len": torch.full((len(lens),), response_len),
                       "group_index": torch.tensor(groups)})


def test_groups_found_in_order_with_prompt_lengths():
    batch = _batch([40, 40, 10, 10, 10, 10, 40, 40], [0, 0, 1, 1, 2, 2, 3, 3])
    assert _coordinator()._prompt_groups(batch, 2) == [([0, 1], 40), ([2, 3], 10), ([4, 5], 10), ([6, 7], 40)]


@pytest.mark.parametrize("groups, dp", [
    ([0, 0, 1, 1, 1, 2, 2, 2], 2),  # groups of different sizes
    ([0, 0, 1, 1, 2, 2, 3, 3], 3),  # 4 groups do not divide over 3 ranks
    ([0, 1, 2, 3, 4, 5, 6, 7], 2),  # n = 1: nothing to share
])
def test_single_sample_balancing_when_groups_do_not_fit(groups, dp):
    assert _coordinator()._prompt_groups(_batch([10] * 8, groups), dp) is None


def test_balanced_layout_stays_and_unbalanced_one_moves_whole_groups():
    coord = _coordinator()
    lengths = [45, 45, 15, 15, 15, 15, 45, 45]
    groups = [([0, 1], 40), ([2, 3], 10), ([4, 5], 10), ([6, 7], 40)]
    holdings = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert coord._balance_groups(holdings, lengths, groups, 2) == holdings
    assert coord.last_imbalance == 1.0
    # g0 and g3 (the two heavy groups) start on rank 0: 100 vs 40.
    holdings = [[0, 1, 6, 7], [2, 3, 4, 5]]
    heavy_first = [([0, 1], 40), ([6, 7], 40), ([2, 3], 10), ([4, 5], 10)]
    target = coord._balance_groups(holdings, lengths, heavy_first, 2)
    assert coord.last_imbalance == 1.0
    assert sorted(sorted(t) for t in target) != sorted(sorted(h) for h in holdings)
    for ids in target:  # 4 samples: one heavy and one light group, each whole and adjacent
        assert len(ids) == 4
        assert {tuple(ids[:2]), tuple(ids[2:])} <= {(0, 1), (6, 7), (2, 3), (4, 5)}
        assert sorted(lengths[i] for i in ids) == [15, 15, 45, 45]
