"""Redistribution plans: hand-computed plans, simulated execution, locality of balanced plans."""

from __future__ import annotations

import itertools
import random

import pytest

from distflow.data.balance import balance_partition, rank_loads
from distflow.data.redistribute import balanced_assignment, plan_redistribution

pytestmark = pytest.mark.unit


def simulate(plan):
    """Execute a plan on id lists: what each destination ends up with."""
    out = []
    for dst in range(plan.num_ranks):
        received = [plan.src_holdings[src][p] for src in range(plan.num_ranks) for p in plan.sends[src][dst]]
        out.append([received[i] for i in plan.recv_order[dst]])
    return out


def simulate_segments(plan):
    """The same through recv_segments (the path exchange uses)."""
    out = []
    for dst in range(plan.num_ranks):
        ids = []
        for src, start, stop in plan.recv_segments(dst):
            piece = [plan.src_holdings[src][p] for p in plan.sends[src][dst]]
            ids += piece[start:stop]
        out.append(ids)
    return out


def random_layouts(rng, num_ranks, num_ids):
    def split(ids):
        cuts = sorted(rng.randint(0, len(ids)) for _ in range(num_ranks - 1))
        return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]

    ids = rng.sample(range(1000), num_ids)
    holdings = split(ids)
    rng.shuffle(ids)
    return holdings, split(ids)


def test_plan_by_hand():
    plan = plan_redistribution([[0, 1, 2], [3, 4]], [[4, 0], [1, 2, 3]])
    assert plan.sends == (((0,), (1, 2)), ((1,), (0,)))
    # rank 0 receives [0] from itself then [4] from rank 1, and wants 4 first
    assert plan.recv_order == ((1, 0), (0, 1, 2))
    assert plan.recv_segments(0) == ((1, 0, 1), (0, 0, 1))
    assert plan.recv_segments(1) == ((0, 0, 2), (1, 0, 1))
    assert plan.bytes_matrix([10, 11, 12, 13, 14]) == [[10, 23], [14, 13]]
    assert plan.num_moved_samples() == 3
    assert not plan.is_identity


def test_unchanged_layout_is_identity_and_moves_zero_bytes():
    holdings = [[5, 1], [], [7, 3, 9]]
    plan = plan_redistribution(holdings, holdings)
    assert plan.is_identity
    assert plan.num_moved_samples() == 0
    sizes = {g: 100 for g in (1, 3, 5, 7, 9)}
    assert plan.bytes_matrix(sizes) == [[200, 0, 0], [0, 0, 0], [0, 0, 300]]


def test_reordering_within_a_rank_moves_nothing_but_is_not_identity():
    plan = plan_redistribution([[0, 1], [2]], [[1, 0], [2]])
    assert not plan.is_identity
    assert plan.num_moved_samples() == 0
    assert plan.sends[0][0] == (1, 0)


def test_every_sample_reaches_its_planned_rank_in_order():
    rng = random.Random(0)
    for _ in range(200):
        holdings, assignment = random_layouts(rng, rng.randint(1, 6), rng.randint(0, 30))
        plan = plan_redistribution(holdings, assignment)
        assert simulate(plan) == assignment
        assert simulate_segments(plan) == assignment
        assert plan.is_identity == (holdings == assignment)


def test_invalid_plans_name_the_sample():
    with pytest.raises(ValueError, match="id 1 is held by rank 0 and rank 1"):
        plan_redistribution([[0, 1], [1]], [[0], [1, 1]])
    with pytest.raises(ValueError, match="id 1 is assigned to rank 0 and again to rank 1"):
        plan_redistribution([[0, 1], []], [[1], [1, 0]])
    with pytest.raises(ValueError, match="sample id 9 that no rank holds"):
        plan_redistribution([[0], []], [[0], [9]])
    with pytest.raises(ValueError, match=r"\[1\] are held but assigned to no rank"):
        plan_redistribution([[0, 1], []], [[0], []])
    with pytest.raises(ValueError, match="one list per rank"):
        plan_redistribution([[0]], [[0], []])


def test_balanced_layout_stays_put():
    holdings = [[0, 1], [2, 3]]
    assert balanced_assignment(holdings, [5, 5, 5, 5]) == holdings
    assert plan_redistribution(holdings, balanced_assignment(holdings, [5, 5, 5, 5])).is_identity


def test_balanced_assignment_reaches_the_partition_max_load():
    rng = random.Random(1)
    for _ in range(50):
        num_ranks = rng.randint(1, 5)
        holdings, _ = random_layouts(rng, num_ranks, rng.randint(0, 25))
        costs = {g: rng.randint(1, 50) for held in holdings for g in held}
        assignment = balanced_assignment(holdings, costs)
        flat = [costs[g] for held in holdings for g in held]
        best = max(rank_loads(flat, balance_partition(flat, num_ranks)), default=0)
        loads = [sum(costs[g] for g in ids) for ids in assignment]
        assert max(loads, default=0) <= best
        assert sorted(g for ids in assignment for g in ids) == sorted(costs)


def test_bins_go_where_their_bytes_already_are():
    # LPT bins: {0, 2} and {1, 3}; rank 1 holds 2 and 3 (the heavy ones)
    holdings = [[0, 1], [2, 3]]
    costs = {0: 1, 1: 1, 2: 10, 3: 10}
    sizes = {0: 1, 1: 1, 2: 10, 3: 100}
    # weighted by cost both bins have 10 on rank 1: the lower bin index wins it
    assert balanced_assignment(holdings, costs) == [[1, 3], [0, 2]]
    # weighted by bytes, bin {1, 3} has 100 on rank 1 and gets it
    assert balanced_assignment(holdings, costs, sample_nbytes=sizes) == [[0, 2], [1, 3]]


def test_greedy_overlap_keeps_at_least_half_of_the_best_matching():
    rng = random.Random(2)
    for _ in range(40):
        holdings, _ = random_layouts(rng, 3, 12)
        costs = {g: rng.randint(1, 30) for held in holdings for g in held}
        assignment = balanced_assignment(holdings, costs)
        kept = sum(costs[g] for r, ids in enumerate(assignment) for g in ids if g in holdings[r])
        best = max(
            sum(costs[g] for r, ids in enumerate(perm) for g in ids if g in holdings[r])
            for perm in itertools.permutations(assignment)
        )
        assert kept >= best / 2


def test_fewer_destination_ranks_leave_the_rest_empty():
    holdings = [[0, 1, 2], [3], []]
    assignment = balanced_assignment(holdings, [1, 2, 3, 9], num_ranks=2)
    assert assignment == [[1, 2], [0, 3], []]
    with pytest.raises(ValueError, match="num_ranks = 4 must be in 1..3"):
        balanced_assignment(holdings, [1, 2, 3, 9], num_ranks=4)
