"""Bench-local prototype of faster per-edge planning, measured next to the runtime's.

Not runtime code: it shows what the proposed changes to
``distflow.data.balance.balance_partition``,
``distflow.data.redistribute.balanced_assignment`` / ``plan_redistribution``
and ``distflow.data.exchange``'s size bookkeeping buy, with the same results
contract (equal counts, indices sorted, never worse than Karmarkar-Karp at
few samples per rank, the same bytes on the wire).

Changes against the runtime (measured in docs/benchmarks.md):

1. Start from a vectorised round-robin-by-load placement (items by cost
   descending, k per round, largest to the lightest rank) instead of the
   per-item heap LPT: O(B log B) in numpy.
2. Refine in *pairwise rounds*: the i-th heaviest rank with the i-th
   lightest, every pair's best single swap scored in one [k/2, n, n] array
   and all applied at once; then the runtime's top-rank 2-opt, vectorised
   ([n_top, B] per step), for what is left. The runtime fixes one rank per
   Python step, which is what costs seconds at 512+ ranks.
3. Stop once the max load is within ``tolerance`` (relative) of
   ``lower_bound``: the last 0.1% is not worth planning time.
4. With few samples per rank (<= ``KK_MAX_PER_RANK``) also refine from the
   runtime's LPT and Karmarkar-Karp starts and keep the best, so the result
   is never worse than Karmarkar-Karp there (refinement never raises the max).

``sparse_balanced_assignment`` maps bins to ranks like ``balanced_assignment``
but only scores (bin, rank) pairs that share samples (at most B of them)
instead of all k^2: identical output, O(B log B) instead of O(k^2 log k).

``rank_wire_plan`` is what one rank needs to run its ``all_to_all_single``:
its send row and receive column of the byte matrix, in O(B + N), where the
runtime builds the whole [N][N] ``sends`` plan (``plan_redistribution``) and
the whole [N][N] size matrix (``exchange._size_matrix``) on every rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

TOLERANCE = 1e-3
KK_MAX_PER_RANK = 8


def fast_balance_partition(costs: Sequence[float], num_ranks: int, equal_counts: bool = True,
                           tolerance: float = TOLERANCE, max_steps: int | None = None) -> list[list[int]]:
    """Constrained LPT, then vectorised swap refinement until within ``tolerance`` of the bound.

    Equal counts only (what the coordinator uses); swaps keep every rank's count.

    Returns:
        k lists of indices, each sorted ascending (as the runtime's partitioners).

    Raises:
        ValueError: ``equal_counts=False`` (not prototyped).
    """
    if not equal_counts:
        raise ValueError("fast_balance_partition: only equal_counts=True is prototyped")
    from distflow.data.balance import balance_partition, karmarkar_karp_partition, lower_bound

    n = len(costs)
    c = np.asarray(costs, dtype=np.float64)
    target = lower_bound(costs, num_ranks, equal_counts) * (1 + tolerance)
    starts = [_rounds_start(c, num_ranks)]
    if n <= KK_MAX_PER_RANK * num_ranks:
        for bins in (balance_partition(costs, num_ranks, refine=False),
                     karmarkar_karp_partition(costs, num_ranks)):
            owner = np.empty(n, dtype=np.int64)
            for r, members in enumerate(bins):
                owner[members] = r
            starts.append(owner)
    best, best_max = None, np.inf
    for owner in starts:
        owner = _pairwise_rounds(c, owner, num_ranks, target)
        owner = _refine(c, owner, num_ranks, target, 4 * n if max_steps is None else max_steps)
        loads = np.bincount(owner, weights=c, minlength=num_ranks)
        if loads.max() < best_max:
            best, best_max = owner, loads.max()
    return [sorted(np.flatnonzero(best == r).tolist()) for r in range(num_ranks)]


def _rounds_start(c: np.ndarray, k: int) -> np.ndarray:
    """[B] rank of each item: items by cost descending, k per round, the round's largest
    to the least-loaded rank that still has room (equal counts by construction)."""
    from distflow.data.balance import rank_capacities

    n = len(c)
    order = np.argsort(-c, kind="stable")
    owner = np.empty(n, dtype=np.int64)
    loads = np.zeros(k)
    caps = np.asarray(rank_capacities(n, k))
    for round_index, start in enumerate(range(0, n, k)):
        items = order[start: start + k]
        ranks = np.flatnonzero(caps > round_index)
        ranks = ranks[np.argsort(loads[ranks], kind="stable")][: len(items)]
        owner[items] = ranks
        loads[ranks] += c[items]
    return owner


def _pairwise_rounds(c: np.ndarray, owner: np.ndarray, k: int, target: float,
                     max_rounds: int = 64) -> np.ndarray:
    """Pair the i-th heaviest rank with the i-th lightest; each pair takes its best single swap.

    All pairs are disjoint, so one round fixes up to k/2 ranks at once with
    one [k/2, n, n] array: a round costs what one top-rank step costs, and the
    spread shrinks round after round. Ends when no pair improves.
    """
    counts = np.bincount(owner, minlength=k)
    width = int(counts.max()) if len(owner) else 0
    if width == 0 or k < 2:
        return owner
    slots = np.full((k, width), -1, dtype=np.int64)
    order = np.argsort(owner, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for r in range(k):
        slots[r, : counts[r]] = order[starts[r]: starts[r] + counts[r]]
    cost = np.where(slots >= 0, c[np.maximum(slots, 0)], np.nan)
    loads = np.nansum(cost, axis=1)
    half = k // 2
    for _ in range(max_rounds):
        by_load = np.argsort(loads, kind="stable")
        if loads[by_load[-1]] <= target:
            break
        heavy, light = by_load[::-1][:half], by_load[:half]
        gap = (loads[heavy] - loads[light])[:, None, None]
        delta = cost[heavy][:, :, None] - cost[light][:, None, :]  # [P, n, n]; nan for empty slots
        with np.errstate(invalid="ignore"):
            ok = (delta > 0) & (delta < gap)
        new_max = np.where(ok, np.maximum(loads[heavy][:, None, None] - delta,
                                          loads[light][:, None, None] + delta), np.inf)
        flat = new_max.reshape(half, -1).argmin(axis=1)
        best = new_max.reshape(half, -1)[np.arange(half), flat]
        improve = best < loads[heavy]
        if not improve.any():
            break
        i, j = np.divmod(flat[improve], width)
        hi, lo = heavy[improve], light[improve]
        d = cost[hi, i] - cost[lo, j]
        slots[hi, i], slots[lo, j] = slots[lo, j], slots[hi, i].copy()
        cost[hi, i], cost[lo, j] = cost[lo, j], cost[hi, i].copy()
        loads[hi] -= d
        loads[lo] += d
    owner = owner.copy()
    for r in range(k):
        owner[slots[r, : counts[r]]] = r
    return owner


def _refine(c: np.ndarray, owner: np.ndarray, k: int, target: float, max_steps: int) -> np.ndarray:
    """2-opt on the most loaded rank: the swap minimising the pair's new max, until none helps."""
    loads = np.bincount(owner, weights=c, minlength=k)
    for _ in range(max_steps):
        top = int(np.argmax(loads))
        if loads[top] <= target:
            break
        mine = np.flatnonzero(owner == top)
        others = np.flatnonzero(owner != top)
        gap = loads[top] - loads[owner[others]]  # [m]
        delta = c[mine][:, None] - c[others][None, :]  # [n_top, m]
        ok = (delta > 0) & (delta < gap[None, :])
        new_max = np.where(ok, np.maximum(loads[top] - delta, loads[owner[others]][None, :] + delta), np.inf)
        flat = int(np.argmin(new_max))
        best = new_max.flat[flat]
        if not np.isfinite(best) or best >= loads[top]:
            break
        i, j = np.unravel_index(flat, new_max.shape)
        a, b = mine[i], others[j]
        other = owner[b]
        d = c[a] - c[b]
        owner[a], owner[b] = other, top
        loads[top] -= d
        loads[other] += d
    return owner


def sparse_balanced_assignment(src_holdings: Sequence[Sequence[int]], costs, num_ranks: int | None = None,
                               partition=fast_balance_partition) -> list[list[int]]:
    """``redistribute.balanced_assignment`` with a pluggable partition and sparse overlap scoring.

    Same rules: identity when the current layout is already as balanced;
    otherwise bins go to ranks by most bytes already in place (ties: lower
    bin, lower rank), leftovers in order. Scores only pairs that share samples.
    """
    from distflow.data.redistribute import _keeps_up

    group = len(src_holdings)
    num_ranks = group if num_ranks is None else num_ranks
    ids = [g for held in src_holdings for g in held]
    holder = {g: src for src, held in enumerate(src_holdings) for g in held}
    bins = partition([costs[g] for g in ids], num_ranks)
    if _keeps_up(src_holdings, costs, bins, num_ranks, True):
        return [list(h) for h in src_holdings]
    bins_ids = [[ids[i] for i in sorted(b)] for b in bins]
    overlap: dict[tuple[int, int], float] = {}
    for b, members in enumerate(bins_ids):
        for g in members:
            if holder[g] < num_ranks:
                key = (b, holder[g])
                overlap[key] = overlap.get(key, 0.0) + float(costs[g])
    rank_of_bin, taken = {}, set()
    for (b, r), score in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if score > 0 and b not in rank_of_bin and r not in taken:
            rank_of_bin[b] = r
            taken.add(r)
    free = iter(r for r in range(num_ranks) if r not in taken)
    for b in range(len(bins_ids)):
        if b not in rank_of_bin:
            rank_of_bin[b] = next(free)
    out: list[list[int]] = [[] for _ in range(group)]
    for b, r in rank_of_bin.items():
        out[r] = bins_ids[b]
    return out


def rank_wire_plan(src_holdings: Sequence[Sequence[int]], dst_assignment: Sequence[Sequence[int]],
                   lengths: Sequence[int], rank: int, bytes_per_token: int, bytes_per_sample: int):
    """(send_positions [N] lists, send_bytes [N], recv_bytes [N]) of one rank, in O(B + N).

    ``lengths[id]`` is sample id's tokens; byte sizes ignore the runtime's
    8-byte field padding (a constant per piece).
    """
    num_ranks = len(src_holdings)
    owner = {}
    for src, held in enumerate(src_holdings):
        for pos, gid in enumerate(held):
            owner[gid] = (src, pos)
    send_positions: list[list[int]] = [[] for _ in range(num_ranks)]
    send_bytes = [0] * num_ranks
    recv_bytes = [0] * num_ranks
    for dst, ids in enumerate(dst_assignment):
        for gid in ids:
            src, pos = owner[gid]
            if src == rank and dst != rank:
                send_positions[dst].append(pos)
                send_bytes[dst] += lengths[gid] * bytes_per_token + bytes_per_sample
            elif dst == rank and src != rank:
                recv_bytes[src] += lengths[gid] * bytes_per_token + bytes_per_sample
    return send_positions, send_bytes, recv_bytes
