"""DAPO dynamic sampling: which groups carry signal, and the global selection every rank computes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from distflow.algorithms import groups_with_signal, plan_group_selection

pytestmark = pytest.mark.unit


def test_groups_whose_scores_all_agree_are_dropped_whatever_their_order():
    # g7: (1, 1) agree; g3: (0, 1) differ; g5: (0.5,) alone; g2: (0, 0, 0) agree; g9: (0.1, 0.1, 0.2) differ
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.1, 0.0, 0.1, 0.0, 1.0, 0.2])
    groups = torch.tensor([7, 3, 7, 5, 2, 9, 2, 9, 2, 3, 9])
    expected = [False, True, False, False, False, True, False, True, False, True, True]
    assert groups_with_signal(scores, groups).tolist() == expected


def test_selection_prefers_signal_then_earlier_rounds_interleaving_ranks():
    # rank 0: round 0 (S, -, S), round 1 (S);  rank 1: round 0 (-, -, -), round 1 (S, S)
    s0, d0, s1 = (True, 0), (False, 0), (True, 1)
    candidates = [[s0, d0, s0, s1], [d0, d0, d0, s1, s1]]
    # global ids: rank 0 -> 0..3, rank 1 -> 4..8
    # order: signal round 0 (ids 0, 2), signal round 1 interleaved by rank (3, 7, 8) -> take 4: 0, 2, 3, 7
    target = plan_group_selection(candidates, num_groups=4)
    # rank 0 keeps 0 and 2 (its quota of 2); its surplus 3 goes to rank 1, which keeps 7
    assert target == [[0, 2], [7, 3]]


def test_selection_pads_with_groups_without_signal_when_rounds_run_out():
    s0, d0 = (True, 0), (False, 0)
    candidates = [[d0, d0], [s0, d0]]
    # one group with signal (id 2), then no-signal groups interleaved: rank 0 pos 0 (id 0), rank 1 pos 0 (id 3)...
    target = plan_group_selection(candidates, num_groups=2)
    assert target == [[0], [2]]
    assert plan_group_selection(candidates, num_groups=4) == [[0, 1], [2, 3]]


def test_selection_gives_every_rank_its_quota_of_distinct_groups_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        num_ranks = rng.choice([1, 2, 3, 4])
        quota = rng.randint(1, 3)
        num_groups = quota * num_ranks
        candidates = []
        for _ in range(num_ranks):
            mine = [(rng.random() < 0.4, 0) for _ in range(quota)]  # round 0: the rank's full share
            mine += [(True, r) for r in range(1, rng.randint(1, 3)) for _ in range(rng.randint(0, 2))]
            candidates.append(mine)
        target = plan_group_selection(candidates, num_groups)
        flat = [c for rank in candidates for c in rank]
        chosen = [g for held in target for g in held]
        assert [len(held) for held in target] == [quota] * num_ranks
        assert len(set(chosen)) == num_groups
        # no group without signal is taken while one with signal is left out
        with_signal = {g for g, (signal, _) in enumerate(flat) if signal}
        assert with_signal <= set(chosen) or all(flat[g][0] for g in chosen)
        # a rank keeps min(its selected groups, quota) of its own: only the surplus moves
        offsets = list(itertools.accumulate((len(c) for c in candidates), initial=0))
        for rank, held in enumerate(target):
            own_selected = [g for g in chosen if offsets[rank] <= g < offsets[rank + 1]]
            own_kept = [g for g in held if offsets[rank] <= g < offsets[rank + 1]]
            assert len(own_kept) == min(len(own_selected), quota)


def test_selection_needs_a_divisible_batch_and_enough_candidates():
    with pytest.raises(ValueError, match="evenly"):
        plan_group_selection([[(True, 0)] * 3, [(True, 0)] * 3], num_groups=3)
    with pytest.raises(ValueError, match="candidates"):
        plan_group_selection([[(True, 0)], [(True, 0)]], num_groups=4)
