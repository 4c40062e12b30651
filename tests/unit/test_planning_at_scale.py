"""Per-edge planning at scale: the vectorised balancer, sparse bin matching, per-rank plans.

Carried over from the tests of the former bench prototype (tests/bench/plan_prototype.py):
brute force, Karmarkar-Karp and the whole [N][N] plan are the oracles.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distflow.data import balance
from distflow.data.balance import (
    balance_partition,
    karmarkar_karp_partition,
    lower_bound,
    rank_capacities,
    rank_loads,
)
from distflow.data.batch import SAMPLE, TOKEN, FieldSpec
from distflow.data.wire import piece_nbytes, rank_wire_sizes
from distflow.data.redistribute import balanced_assignment, plan_for_rank, plan_redistribution

pytestmark = pytest.mark.unit


def _long_tailed(rng, count):
    return [float(rng.choice([rng.randint(1, 50), rng.randint(100, 5000)])) for _ in range(count)]


def _random_holdings(rng, num_ranks, max_per_rank):
    holdings, gid = [], 0
    for _ in range(num_ranks):
        count = rng.randint(0, max_per_rank)
        holdings.append(list(range(gid, gid + count)))
        gid += count
    return holdings, gid


# --- balance_partition, equal counts ---------------------------------------------------


def test_partition_has_equal_counts_sorted_indices_and_every_index_once():
    rng = random.Random(0)
    for _ in range(100):
        k = rng.randint(1, 9)
        costs = _long_tailed(rng, rng.randint(0, 60))
        bins = balance_partition(costs, k)
        assert sorted(i for b in bins for i in b) == list(range(len(costs)))
        assert [len(b) for b in bins] == rank_capacities(len(costs), k)
        assert all(b == sorted(b) for b in bins)


def test_partition_is_never_worse_than_karmarkar_karp_with_few_samples_per_rank():
    rng = random.Random(1)
    for _ in range(300):
        k = rng.randint(2, 6)
        costs = _long_tailed(rng, rng.randint(k, balance.MULTI_START_MAX_PER_RANK * k))
        ours = max(rank_loads(costs, balance_partition(costs, k)))
        assert ours <= max(rank_loads(costs, karmarkar_karp_partition(costs, k)))
        assert ours <= max(rank_loads(costs, balance_partition(costs, k, refine=False)))


def test_many_samples_per_rank_reach_the_bound_within_the_tolerance():
    rng = random.Random(2)
    costs = [float(rng.randint(100, 600)) for _ in range(64 * 16)]
    assert len(costs) > balance.EXACT_MAX_ITEMS
    loads = rank_loads(costs, balance_partition(costs, 64))
    assert max(loads) <= lower_bound(costs, 64) * (1 + balance.REFINE_TOLERANCE)


def test_small_inputs_end_at_the_bound_or_where_no_swap_lowers_the_max():
    """No tolerance up to EXACT_MAX_ITEMS: the max rank has no improving swap left."""
    rng = random.Random(3)
    for _ in range(40):
        k = rng.randint(2, 12)
        costs = _long_tailed(rng, rng.randint(k, 40))
        bins = balance_partition(costs, k)
        loads = rank_loads(costs, bins)
        top = max(range(k), key=lambda r: (loads[r], -r))
        if loads[top] <= lower_bound(costs, k):
            continue
        for other in range(k):
            for i in bins[top]:
                for j in bins[other]:
                    d = costs[i] - costs[j]
                    if other != top and 0 < d < loads[top] - loads[other]:
                        assert max(loads[top] - d, loads[other] + d) >= loads[top]


def test_long_tailed_batch_at_scale_balances_within_the_tolerance():
    rng = random.Random(4)
    costs = [float(min(32768, max(32, int(rng.lognormvariate(7.6, 1.0)))) + rng.randint(64, 1024))
             for _ in range(4096)]
    bins = balance_partition(costs, 64)
    assert [len(b) for b in bins] == [64] * 64
    assert max(rank_loads(costs, bins)) <= lower_bound(costs, 64) * (1 + balance.REFINE_TOLERANCE)


def test_partition_is_the_same_for_lists_tuples_and_repeated_calls():
    rng = random.Random(5)
    costs = [rng.random() * 1000 for _ in range(700)]  # non-integer costs, above EXACT_MAX_ITEMS
    first = balance_partition(costs, 24)
    assert balance_partition(tuple(costs), 24) == first
    assert balance_partition(list(costs), 24) == first


def test_best_swaps_match_a_brute_force_search_over_all_pairs():
    """The batched binary search finds each pair's best single swap (loop vs vectorised)."""
    rng = random.Random(6)
    for _ in range(100):
        k = rng.randint(2, 8)
        n = rng.randint(k, 6 * k)
        c = np.array([float(rng.randint(1, 40)) for _ in range(n)])
        owner = balance._round_robin_by_load(c, k)
        slots = balance._RankSlots(c, owner, k)
        order = np.argsort(slots.loads, kind="stable")
        heavy, light = order[::-1][: k // 2], order[: k // 2]
        new_max, i, j = balance._best_swaps(slots, heavy, light)
        for p, (h, low) in enumerate(zip(heavy, light)):
            gap = slots.loads[h] - slots.loads[low]
            mine = [c[x] for x in np.flatnonzero(owner == h)]
            theirs = [c[x] for x in np.flatnonzero(owner == low)]
            options = [max(slots.loads[h] - (a - b), slots.loads[low] + (a - b))
                       for a in mine for b in theirs if 0 < a - b < gap]
            assert new_max[p] == min(options, default=np.inf)
            if options:
                a, b = slots.cost_at[slots.position[h, i[p]]], slots.cost_at[slots.position[low, j[p]]]
                assert max(slots.loads[h] - (a - b), slots.loads[low] + (a - b)) == new_max[p]


# --- balanced_assignment: sparse overlap scoring ---------------------------------------


def _dense_assignment(src_holdings, costs, num_ranks, sample_nbytes=None):
    """The former all-(bin, rank)-pairs greedy, as the oracle."""
    ids = [g for held in src_holdings for g in held]
    holder = {g: src for src, held in enumerate(src_holdings) for g in held}
    bins = balance_partition([costs[g] for g in ids], num_ranks)
    flat = balanced_assignment(src_holdings, costs, num_ranks, sample_nbytes=sample_nbytes)
    if flat == [list(h) for h in src_holdings]:
        return flat  # the layout kept up: the identity, no matching
    bins_ids = [[ids[i] for i in b] for b in bins]
    weight = costs if sample_nbytes is None else sample_nbytes
    overlap = [[0.0] * num_ranks for _ in bins_ids]
    for b, members in enumerate(bins_ids):
        for g in members:
            if holder[g] < num_ranks:
                overlap[b][holder[g]] += float(weight[g])
    pairs = sorted(((b, r) for b in range(len(bins_ids)) for r in range(num_ranks)),
                   key=lambda br: (-overlap[br[0]][br[1]], br[0], br[1]))
    rank_of_bin, taken = {}, set()
    for b, r in pairs:
        if b not in rank_of_bin and r not in taken:
            rank_of_bin[b] = r
            taken.add(r)
    out = [[] for _ in src_holdings]
    for b, r in rank_of_bin.items():
        out[r] = bins_ids[b]
    return out


def test_sparse_overlap_matching_gives_the_all_pairs_result():
    rng = random.Random(7)
    for trial in range(300):
        group = rng.randint(1, 7)
        holdings, num_ids = _random_holdings(rng, group, 5)
        costs = [float(rng.choice([0, rng.randint(0, 50)])) for _ in range(num_ids)]
        nbytes = [rng.randint(0, 9) for _ in range(num_ids)] if trial % 2 else None
        num_ranks = rng.randint(1, group)
        expected = _dense_assignment(holdings, costs, num_ranks, nbytes)
        assert balanced_assignment(holdings, costs, num_ranks, sample_nbytes=nbytes) == expected, trial


# --- plan_for_rank and the exchange's per-rank sizes ----------------------------------


def test_rank_plan_is_the_whole_plans_row_and_column():
    rng = random.Random(8)
    for _ in range(100):
        k = rng.randint(1, 7)
        holdings, num_ids = _random_holdings(rng, k, 6)
        target = balanced_assignment(holdings, [float(rng.randint(1, 100)) for _ in range(num_ids)])
        if rng.random() < 0.3:
            target = [list(reversed(t)) for t in target]
        whole = plan_redistribution(holdings, target)
        for rank in range(k):
            part = plan_for_rank(holdings, target, rank)
            assert part == whole.for_rank(rank)
            assert part.sends == whole.sends[rank]
            assert part.receives == tuple(row[rank] for row in whole.sends)
            assert part.recv_segments() == whole.recv_segments(rank)
            assert part.is_identity == whole.is_identity
            assert part.src_counts == [len(h) for h in holdings]


def test_rank_plan_rejects_what_the_whole_plan_rejects():
    bad = [
        ([[0, 1], [1]], [[0], [1, 1]], "id 1 is held by rank 0 and rank 1"),
        ([[0, 1], []], [[1], [1, 0]], "id 1 is assigned to rank 0 and again to rank 1"),
        ([[0], []], [[0], [9]], "sample id 9 that no rank holds"),
        ([[0, 1], []], [[0], []], r"\[1\] are held but assigned to no rank"),
        ([[0]], [[0], []], "one list per rank"),
    ]
    for holdings, target, message in bad:
        with pytest.raises(ValueError, match=message):
            plan_redistribution(holdings, target)
        with pytest.raises(ValueError, match=message):
            plan_for_rank(holdings, target, 0)
    with pytest.raises(ValueError, match="rank = 2 must be in 0..1"):
        plan_for_rank([[0], [1]], [[1], [0]], 2)


SCHEMAS = {
    "tokens_and_samples": [FieldSpec("input_ids", TOKEN, torch.int64, ()),
                           FieldSpec("logp", TOKEN, torch.float32, ()),
                           FieldSpec("reward", SAMPLE, torch.float16, (3,))],
    "tokens_only": [FieldSpec("input_ids", TOKEN, torch.int32, ())],
    "no_fields": [],
}


def test_rank_wire_sizes_are_the_size_matrix_row_and_column():
    """Bytes per piece and the group-wide flags equal the former [N][N] bookkeeping."""
    rng = random.Random(9)
    for trial in range(200):
        k = rng.randint(2, 7)
        holdings, num_ids = _random_holdings(rng, k, 6)
        lengths_of = [rng.choice([0, rng.randint(1, 100)]) for _ in range(num_ids)]
        target = balanced_assignment(holdings, [float(n) + 1 for n in lengths_of])
        whole = plan_redistribution(holdings, target)
        lengths = [[lengths_of[g] for g in held] for held in holdings]
        schema = SCHEMAS[rng.choice(sorted(SCHEMAS))]
        node_of_rank = None if trial % 2 else [rng.randint(0, 2) for _ in range(k)]
        sizes = [[piece_nbytes(schema, sum(lengths[s][p] for p in pos), len(pos)) if pos else 0
                  for pos in row] for s, row in enumerate(whole.sends)]
        shm = [[node_of_rank is not None and s != d and node_of_rank[s] == node_of_rank[d]
                for d in range(k)] for s in range(k)]
        on_wire = any(sizes[s][d] and s != d and not shm[s][d] for s in range(k) for d in range(k))
        moved = any(sizes[s][d] for s in range(k) for d in range(k) if s != d)
        for rank in range(k):
            rank_plan = plan_for_rank(holdings, target, rank)
            mine = rank_wire_sizes(rank_plan, schema, lengths, node_of_rank, torch.device("cpu"))
            # CUDA batches never use the node buffer: every moved piece goes over NCCL
            on_cuda = rank_wire_sizes(rank_plan, schema, lengths, node_of_rank, torch.device("cuda", 0))
            assert not any(on_cuda.send_via_shm) and not any(on_cuda.recv_via_shm)
            assert (on_cuda.send, on_cuda.any_on_wire) == (mine.send, moved), trial
            assert mine.send == [0 if d == rank else sizes[rank][d] for d in range(k)], trial
            assert mine.recv == [0 if s == rank else sizes[s][rank] for s in range(k)], trial
            assert mine.send_via_shm == shm[rank]
            assert mine.recv_via_shm == [row[rank] for row in shm]
            assert (mine.any_on_wire, mine.any_moved) == (on_wire, moved), trial
