"""Sequence balancing: hand-computed cases, brute-force optima, invariants."""

from __future__ import annotations

import itertools
import random

import pytest

from distflow.data.balance import (
    balance_partition,
    imbalance,
    karmarkar_karp_partition,
    lower_bound,
    rank_capacities,
    rank_loads,
    sample_cost,
)

from tests.bench.partitioners import contiguous_partition

pytestmark = pytest.mark.unit


def max_load(costs, partition):
    return max(rank_loads(costs, partition))


def brute_force_optimum(costs, num_ranks, equal_counts=True):
    """Smallest max load over every assignment (with the same counts as rank_capacities)."""
    caps = sorted(rank_capacities(len(costs), num_ranks))
    best = float("inf")
    for assign in itertools.product(range(num_ranks), repeat=len(costs)):
        if equal_counts and sorted(assign.count(r) for r in range(num_ranks)) != caps:
            continue
        loads = [0.0] * num_ranks
        for item, rank in enumerate(assign):
            loads[rank] += costs[item]
        best = min(best, max(loads))
    return best


def random_cases(seed=0, count=60):
    rng = random.Random(seed)
    for _ in range(count):
        n, k = rng.choice([(8, 2), (6, 3), (7, 3), (6, 4), (7, 2)])
        yield [rng.randint(1, 100) for _ in range(n)], k


def assert_valid(partition, num_items, num_ranks, equal_counts=True):
    assert len(partition) == num_ranks
    assert sorted(i for part in partition for i in part) == list(range(num_items))
    assert all(part == sorted(part) for part in partition)
    if equal_counts:
        assert sorted(len(p) for p in partition) == sorted(rank_capacities(num_items, num_ranks))


def test_sample_cost_adds_the_quadratic_attention_term():
    assert sample_cost(100) == 100.0
    assert sample_cost(100, alpha=0.01) == 200.0
    with pytest.raises(ValueError, match="alpha"):
        sample_cost(10, alpha=-1)


def test_first_ranks_take_the_remainder():
    assert rank_capacities(10, 4) == [3, 3, 2, 2]
    assert rank_capacities(3, 4) == [1, 1, 1, 0]


def test_lpt_on_descending_costs_is_optimal_by_hand():
    # 8->A 7->B 6->B 5->A 4->A 3->B 2->B(full) 1->A: {8,5,4,1}=18, {7,6,3,2}=18
    costs = [8, 7, 6, 5, 4, 3, 2, 1]
    assert balance_partition(costs, 2, refine=False) == [[0, 3, 4, 7], [1, 2, 5, 6]]


def test_refinement_fixes_the_classic_lpt_miss():
    # LPT: {3,2,2}=7 | {3,2}=5; swapping a 3 for a 2 gives 6 | 6 (optimal)
    costs = [3, 3, 2, 2, 2]
    assert max_load(costs, balance_partition(costs, 2, refine=False)) == 7
    assert balance_partition(costs, 2) == [[2, 3, 4], [0, 1]]
    assert max_load(costs, balance_partition(costs, 2, equal_counts=False)) == 6


def test_partition_is_optimal_on_hand_picked_cases():
    for costs, k, optimum in [
        ([5, 1, 1, 1], 2, 6),
        ([10, 1, 1, 1, 1, 1, 1], 2, 12),  # {10,1,1} | {1,1,1,1}
        ([4, 4, 4, 3, 3, 3, 3, 3, 3], 3, 10),  # {4,3,3} x 3
        ([9, 8, 7, 6, 5, 4], 3, 13),  # {9,4} {8,5} {7,6}
    ]:
        assert max_load(costs, balance_partition(costs, k)) == optimum == brute_force_optimum(costs, k)


def test_partition_is_near_optimal_and_never_worse_than_karmarkar_karp():
    for costs, k in random_cases():
        optimum = brute_force_optimum(costs, k)
        ours = balance_partition(costs, k)
        assert_valid(ours, len(costs), k)
        # measured worst ratio on these cases is ~1.01; 1.05 leaves room
        assert max_load(costs, ours) <= 1.05 * optimum
        assert max_load(costs, ours) <= max_load(costs, karmarkar_karp_partition(costs, k))
        assert max_load(costs, ours) <= max_load(costs, balance_partition(costs, k, refine=False))


def test_unequal_counts_may_give_a_rank_fewer_samples():
    costs = [10, 1, 1, 1, 1, 1, 1]
    partition = balance_partition(costs, 2, equal_counts=False)
    assert partition == [[0], [1, 2, 3, 4, 5, 6]]
    assert_valid(partition, 7, 2, equal_counts=False)


def test_fewer_samples_than_ranks_leaves_ranks_empty():
    assert balance_partition([5, 3], 4) == [[0], [1], [], []]


def test_partition_is_deterministic_and_breaks_ties_by_index():
    costs = [3, 1, 3, 1, 2, 2, 2, 2]
    first = balance_partition(costs, 2)
    assert first == balance_partition(tuple(costs), 2) == balance_partition(list(costs), 2)
    assert balance_partition([1] * 6, 3, refine=False) == [[0, 3], [1, 4], [2, 5]]


def test_karmarkar_karp_is_valid_and_optimal_by_hand():
    costs = [8, 7, 6, 5, 4, 3, 2, 1]
    assert max_load(costs, karmarkar_karp_partition(costs, 2)) == 18
    for costs, k in random_cases(seed=1, count=20):
        for equal_counts in (True, False):
            partition = karmarkar_karp_partition(costs, k, equal_counts=equal_counts)
            assert_valid(partition, len(costs), k, equal_counts)


def test_contiguous_partition_keeps_index_order():
    assert contiguous_partition([1, 2, 3, 4, 5], 2) == [[0, 1, 2], [3, 4]]
    # cumulative midpoints 0.5 1.5 2.5 3.5 6 over a total of 8 -> rank floor(mid * 2 / 8)
    assert contiguous_partition([1, 1, 1, 1, 4], 2, equal_counts=False) == [[0, 1, 2, 3], [4]]


def test_imbalance_is_max_over_mean():
    assert imbalance([1, 2, 3, 4], [[0, 3], [1, 2]]) == 1.0
    assert imbalance([1, 2, 3, 4], [[0, 1], [2, 3]]) == pytest.approx(7 / 5)
    assert imbalance([0, 0], [[0], [1]]) == 1.0


def test_lower_bound_uses_counts_and_pigeonhole():
    # mean 4, max 5; equal counts put one more item with the 5: 5 + 1
    assert lower_bound([5, 1, 1, 1], 2) == 6
    assert lower_bound([5, 1, 1, 1], 2, equal_counts=False) == 5
    # pigeonhole: two of the three largest share a rank
    assert lower_bound([4, 4, 4, 1], 2, equal_counts=False) == 8


def test_lower_bound_never_exceeds_the_optimum():
    for costs, k in random_cases(seed=2, count=30):
        assert lower_bound(costs, k) <= brute_force_optimum(costs, k)
        assert lower_bound(costs, k, equal_counts=False) <= brute_force_optimum(costs, k, False)


def test_large_batches_balance_to_within_a_percent():
    rng = random.Random(0)
    costs = [sample_cost(rng.randint(50, 4000)) for _ in range(4096)]
    partition = balance_partition(costs, 64)
    assert_valid(partition, 4096, 64)
    assert imbalance(costs, partition) < 1.01
    assert imbalance(costs, contiguous_partition(costs, 64)) > 1.05


def test_invalid_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"costs\[1\]"):
        balance_partition([1, -2], 2)
    with pytest.raises(ValueError, match="num_ranks"):
        balance_partition([1, 2], 0)
