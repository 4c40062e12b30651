"""The bench-local planning prototype keeps the runtime's contracts (brute force / runtime as oracle)."""

import random

import pytest

from distflow.data.balance import balance_partition, karmarkar_karp_partition, rank_capacities, rank_loads
from distflow.data.redistribute import balanced_assignment, plan_redistribution
from tests.bench.plan_prototype import fast_balance_partition, rank_wire_plan, sparse_balanced_assignment

# Pure, but under tests/bench: conftest skips everything here unless -m names bench.
pytestmark = [pytest.mark.unit, pytest.mark.bench]


def _random_costs(rng, count):
    return [float(rng.choice([rng.randint(1, 50), rng.randint(100, 5000)])) for _ in range(count)]


def test_prototype_partition_has_equal_counts_and_every_index_once():
    rng = random.Random(0)
    for _ in range(100):
        k = rng.randint(1, 9)
        costs = _random_costs(rng, rng.randint(0, 60))
        bins = fast_balance_partition(costs, k)
        assert sorted(i for b in bins for i in b) == list(range(len(costs)))
        assert [len(b) for b in bins] == rank_capacities(len(costs), k)
        assert all(b == sorted(b) for b in bins)


def test_prototype_is_never_worse_than_karmarkar_karp_with_few_samples_per_rank():
    rng = random.Random(1)
    for _ in range(300):
        k = rng.randint(2, 6)
        costs = _random_costs(rng, rng.randint(k, 8 * k))
        mine = max(rank_loads(costs, fast_balance_partition(costs, k)))
        assert mine <= max(rank_loads(costs, karmarkar_karp_partition(costs, k))) + 1e-9


def test_prototype_reaches_the_bound_within_tolerance_on_many_samples_per_rank():
    rng = random.Random(2)
    costs = [float(rng.randint(100, 600)) for _ in range(64 * 16)]
    loads = rank_loads(costs, fast_balance_partition(costs, 64))
    assert max(loads) <= sum(costs) / 64 * 1.001


def test_sparse_assignment_matches_the_runtime_for_the_same_partition():
    rng = random.Random(3)
    for trial in range(300):
        k = rng.randint(1, 6)
        holdings, gid = [], 0
        for _ in range(k):
            n = rng.randint(0, 5)
            holdings.append(list(range(gid, gid + n)))
            gid += n
        costs = [float(rng.randint(0, 50)) for _ in range(gid)]
        expected = balanced_assignment(holdings, costs, k, partitioner="lpt")
        assert sparse_balanced_assignment(holdings, costs, k, partition=balance_partition) == expected, trial


def test_rank_wire_plan_matches_the_runtime_plan_row_and_column():
    rng = random.Random(4)
    for _ in range(50):
        k = rng.randint(2, 7)
        holdings, gid = [], 0
        for _ in range(k):
            n = rng.randint(0, 6)
            holdings.append(list(range(gid, gid + n)))
            gid += n
        lengths = [rng.randint(1, 100) for _ in range(gid)]
        target = balanced_assignment(holdings, [float(x) for x in lengths], k)
        plan = plan_redistribution(holdings, target)
        sizes = plan.bytes_matrix([n * 21 + 28 for n in lengths])
        for rank in range(k):
            positions, send, recv = rank_wire_plan(holdings, target, lengths, rank, 21, 28)
            assert [list(p) for d, p in enumerate(positions) if d != rank] == \
                [list(plan.sends[rank][d]) for d in range(k) if d != rank]
            assert send == [0 if d == rank else sizes[rank][d] for d in range(k)]
            assert recv == [0 if s == rank else sizes[s][rank] for s in range(k)]
