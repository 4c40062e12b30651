"""Balancing whole prompt groups when the actor shares prompt prefixes.

Hand-checked: four groups of two samples, prompt lengths 40/10/10/40, all
responses 5 tokens. A group's cost is its prompt once plus its responses
(40 + 10 = 50, or 10 + 10 = 20). Held as [g0, g1] on rank 0 and [g2, g3] on
rank 1 (loads 70 / 70) the layout is already balanced and nothing moves; held
as [g0, g3] / [g1, g2] (100 / 40) the best split is 70 / 70, one light and one
heavy group per rank.
"""

import pytest

from distflow.coordinator import DataCoordinator, prompt_groups
from distflow.data.counters import TransferCounters
from distflow.planner import build_plan
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

LENGTHS = [45, 45, 15, 15, 15, 15, 45, 45]


def _coordinator():
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                       "rollout": {"n": 2}, "cluster": {"numNodes": 2}})
    return DataCoordinator(spec, build_plan(spec), 0, TransferCounters())


def test_groups_found_in_order_with_prompt_lengths():
    rows = [[0, 40], [0, 40], [1, 10], [1, 10], [2, 10], [2, 10], [3, 40], [3, 40]]
    assert prompt_groups(rows, 2) == [([0, 1], 40), ([2, 3], 10), ([4, 5], 10), ([6, 7], 40)]


@pytest.mark.parametrize("groups, dp", [
    ([0, 0, 1, 1, 1, 2, 2, 2], 2),  # groups of different sizes
    ([0, 0, 1, 1, 2, 2, 3, 3], 3),  # 4 groups do not divide over 3 ranks
    ([0, 1, 2, 3, 4, 5, 6, 7], 2),  # n = 1: nothing to share
])
def test_single_sample_balancing_when_groups_do_not_fit(groups, dp):
    assert prompt_groups([[g, 10] for g in groups], dp) is None


def test_balanced_layout_stays():
    coord = _coordinator()
    holdings = [[0, 1, 2, 3], [4, 5, 6, 7]]
    groups = [([0, 1], 40), ([2, 3], 10), ([4, 5], 10), ([6, 7], 40)]
    assert coord._balance_groups(holdings, LENGTHS, groups, 2) == holdings
    assert coord.last_imbalance == 1.0


def test_unbalanced_layout_moves_whole_groups():
    coord = _coordinator()
    holdings = [[0, 1, 6, 7], [2, 3, 4, 5]]  # the two heavy groups start on rank 0: 100 vs 40
    groups = [([0, 1], 40), ([6, 7], 40), ([2, 3], 10), ([4, 5], 10)]
    target = coord._balance_groups(holdings, LENGTHS, groups, 2)
    assert coord.last_imbalance == 1.0
    for ids in target:  # 4 samples: one heavy and one light group, each whole and adjacent
        assert len(ids) == 4
        assert {tuple(ids[:2]), tuple(ids[2:])} <= {(0, 1), (6, 7), (2, 3), (4, 5)}
        assert sorted(LENGTHS[i] for i in ids) == [15, 15, 45, 45]


def test_back_to_origin_returns_every_sample_to_its_generating_rank_in_generation_order():
    from distflow.coordinator import _back_to_origin

    # rank 0 holds ids 0..2, rank 1 ids 3..4; origins [rank, index] per id in global id order
    holdings = [[0, 1, 2], [3, 4]]
    origins = [[1, 1], [0, 1], [1, 0], [0, 0], [0, 2]]
    assert _back_to_origin(holdings, origins) == [[3, 1, 4], [2, 0]]
