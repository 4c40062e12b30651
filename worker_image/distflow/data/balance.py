"""Sequence-length balancing: split a batch of samples over dp ranks.

Pure and deterministic: every rank all-gathers the lengths, calls the same
function and gets the same partition, so no coordinator is needed (DistFlow,
arXiv 2507.13833, "load balancing").

A *partition* is ``list[list[int]]``: for each rank, the indices (into
``costs``) of the samples it gets, sorted ascending. With ``equal_counts``
every rank gets ``B // num_ranks`` samples and the first
``B % num_ranks`` ranks one more, so micro-batch counts line up across ranks
(FSDP runs the same number of forward/backward passes everywhere).

Deliberately simplified: costs are one number per sample (tokens, or
tokens + alpha*tokens^2 for attention); there is no per-rank speed model.

The equal-counts refinement (what the coordinator runs before every balanced
move) is vectorised with numpy: 4,096 samples over 64 ranks plan in a few ms
(docs/benchmarks.md, "The balancer"). Its floating-point operations run in a
fixed order, so every rank still computes the same partition.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Sequence

import numpy as np

Partition = list[list[int]]

REFINE_TOLERANCE = 1e-3
"""Equal-counts refinement stops once the max load is within this fraction above
``lower_bound``: at thousands of samples the last 0.1% costs more planning time
than it saves in the step."""
EXACT_MAX_ITEMS = 512
"""Up to this many samples the tolerance is 0 (refine until the bound or a local
optimum): small inputs are cheap, and there exact results matter more."""
MULTI_START_MAX_PER_RANK = 8
"""Up to this many samples per rank the refinement also starts from plain LPT and
Karmarkar-Karp and keeps the best: there one long sample decides the max load
and the swap search alone can stall above what differencing finds."""


def sample_cost(num_tokens: float, alpha: float = 0.0) -> float:
    """Cost of one sample: ``num_tokens + alpha * num_tokens**2``.

    The linear term models MLP/projection work, the quadratic one attention;
    ``alpha`` ~ 1 / (attention-dominated length) in tokens, e.g. 1/4096.

    Raises:
        ValueError: if ``num_tokens`` or ``alpha`` is negative.
    """
    if num_tokens < 0 or alpha < 0:
        raise ValueError(
            f"sample_cost: num_tokens={num_tokens} and alpha={alpha} must be >= 0"
        )
    return float(num_tokens) + alpha * float(num_tokens) ** 2


def rank_capacities(num_items: int, num_ranks: int) -> list[int]:
    """Samples per rank under equal counts: ``B // k``, first ``B % k`` get one more."""
    _check_ranks(num_ranks)
    base, extra = divmod(num_items, num_ranks)
    return [base + (1 if r < extra else 0) for r in range(num_ranks)]


def balance_partition(
    costs: Sequence[float],
    num_ranks: int,
    equal_counts: bool = True,
    refine: bool = True,
) -> Partition:
    """Constrained longest-processing-time partition, plus optional swap refinement.

    Without ``refine``: LPT (Graham 1969): items sorted by cost descending
    (ties by index), each given to the least-loaded rank that still has room
    (ties by rank index). With ``equal_counts`` rank ``r`` has room for
    ``rank_capacities(B, k)[r]`` items; otherwise capacity is unlimited.

    With ``refine`` and ``equal_counts`` (what the coordinator runs), a
    vectorised swap local search (the pairwise-interchange improvement of
    multiprocessor schedules, Finn & Horowitz 1979, with swaps only so every
    rank keeps its count), as prototyped and measured in docs/benchmarks.md
    ("The balancer"):

    1. Start: items by cost descending, k per round, the round's largest to
       the least-loaded rank (LPT by rounds, one numpy sort per round).
    2. Pairwise rounds: the i-th heaviest rank is paired with the i-th
       lightest and every pair applies its best single swap at once; the best
       partner of each item is found by binary search (see ``_best_swaps``).
    3. 2-opt on the most loaded rank: its best swap with any lighter rank,
       one rank per step, at most ``4 * B`` steps.

    Every accepted swap strictly lowers the larger load of its pair, so the
    max load never rises and the search terminates. It stops at
    ``lower_bound`` (rounded up for integer costs) or, above
    ``EXACT_MAX_ITEMS`` samples, at ``(1 + REFINE_TOLERANCE) * lower_bound``.
    With at most ``MULTI_START_MAX_PER_RANK`` samples per rank the search also
    runs from the plain LPT and ``karmarkar_karp_partition`` starts and the
    lowest max load wins (earlier start on ties), so the result is never worse
    than either of them there.

    With ``refine`` and unequal counts: 2-opt on the most loaded rank, moving
    or swapping items while that lowers the larger of the two loads, from the
    LPT and the Karmarkar-Karp starts (the lower max load wins, LPT on ties);
    at most ``4 * B`` steps, stopping at ``lower_bound``.

    Cost (equal counts): O(B log B) numpy work for the start and per round or
    step, plus O(B / k) Python steps for the start; 4,096 samples over 64
    ranks take a few ms.

    Args:
        costs: [B] non-negative cost per sample (see ``sample_cost``).
        num_ranks: k >= 1.
        equal_counts: give every rank the same number of samples (+-1).
        refine: run the swap refinement.

    Returns:
        k lists of sample indices, each sorted ascending. Deterministic: the
        same costs give the same partition on every rank.

    Raises:
        ValueError: on ``num_ranks < 1`` or a negative cost.
    """
    _check_costs(costs)
    _check_ranks(num_ranks)
    n = len(costs)
    if equal_counts and refine:
        return _balance_equal_counts(costs, num_ranks)
    bins = _lpt(costs, rank_capacities(n, num_ranks) if equal_counts else [n] * num_ranks)
    if refine:
        # 2-opt alone stalls in local optima that the differencing method
        # avoids (measured: worse than Karmarkar-Karp on ~8% of random
        # 7-8 item cases), so refine both starts and keep the better.
        kk_bins = karmarkar_karp_partition(costs, num_ranks, equal_counts)
        candidates = [bins, kk_bins]
        for start in candidates:
            _refine_by_moves(costs, start, max_steps=4 * n)
        bins = min(candidates, key=lambda b: max(rank_loads(costs, b), default=0.0))
    return [sorted(b) for b in bins]


def _lpt(costs: Sequence[float], caps: Sequence[int]) -> Partition:
    """Plain constrained LPT: rank r takes at most ``caps[r]`` items (unsorted bins)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(len(caps)) if caps[r] > 0]
    bins: Partition = [[] for _ in caps]
    for i in order:
        load, r = heapq.heappop(heap)
        bins[r].append(i)
        if len(bins[r]) < caps[r]:
            heapq.heappush(heap, (load + costs[i], r))
    return bins


def _balance_equal_counts(costs: Sequence[float], num_ranks: int) -> Partition:
    """``balance_partition`` with ``equal_counts`` and ``refine`` (inputs already checked)."""
    c = np.asarray(costs, dtype=np.float64)
    n = len(c)
    if num_ranks == 1 or n <= 1:
        return [list(range(n)) if r == 0 else [] for r in range(num_ranks)]
    exact = lower_bound(costs, num_ranks)
    bound = math.ceil(exact) if np.all(np.mod(c, 1) == 0) else exact  # integer costs: integer max load
    tolerance = 0.0 if n <= EXACT_MAX_ITEMS else REFINE_TOLERANCE
    target = max(bound, exact * (1 + tolerance))
    starts = [_round_robin_by_load(c, num_ranks)]
    if n <= MULTI_START_MAX_PER_RANK * num_ranks:
        starts += [_owners_of(bins, n) for bins in (
            _lpt(costs, rank_capacities(n, num_ranks)), karmarkar_karp_partition(costs, num_ranks))]
    best, best_max, tried = None, math.inf, []
    for owner in starts:
        if any(np.array_equal(owner, seen) for seen in tried):
            continue  # LPT by rounds often equals the heap LPT at few samples per rank
        tried.append(owner)
        slots = _RankSlots(c, owner, num_ranks)
        _pairwise_rounds(slots, target)
        _top_rank_swaps(slots, target, max_steps=4 * n)
        owner = slots.owners()
        top = np.bincount(owner, weights=c, minlength=num_ranks).max()
        if top < best_max:
            best, best_max = owner, top
        if best_max <= bound:
            break  # nothing can beat the bound
    order = np.argsort(best, kind="stable")  # grouped by rank, indices ascending within a rank
    counts = np.bincount(best, minlength=num_ranks)
    return [part.tolist() for part in np.split(order, np.cumsum(counts)[:-1])]


def _owners_of(bins: Partition, num_items: int) -> np.ndarray:
    """[B] rank of each item of a partition."""
    owner = np.empty(num_items, dtype=np.int64)
    for r, members in enumerate(bins):
        owner[members] = r
    return owner


def _round_robin_by_load(c: np.ndarray, num_ranks: int) -> np.ndarray:
    """[B] rank of each item: LPT by rounds, equal counts by construction.

    Items by cost descending (ties by index) are taken ``num_ranks`` at a time;
    a round's i-th largest goes to its i-th least-loaded rank (ties by rank
    index). The last, partial round fills ranks 0..B%k-1, the ranks
    ``rank_capacities`` gives one more item.
    """
    n = len(c)
    order = np.argsort(-c, kind="stable")
    owner = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_ranks)
    for start in range(0, n, num_ranks):
        items = order[start: start + num_ranks]
        ranks = np.argsort(loads[: len(items)], kind="stable")
        owner[items] = ranks
        loads[ranks] += c[items]
    return owner


class _RankSlots:
    """The refinement's state: each rank's items in a row, ascending by cost.

    Items are named by their *position* in the global order by (cost, index):
    ``position`` is [k, w] (w = the largest count), each row ascending, and a
    rank with fewer items holds the sentinel ``B`` in its last slot. Positions
    are integers, so rows stay sorted with integer sorts and partner searches
    are exact (``_best_swaps``). ``cost_at[p]`` is the cost of position p
    ([B + 1], +inf for the sentinel: empty slots never pass a swap's bounds),
    ``item_at[p]`` its sample index; ``loads`` is [k].
    """

    def __init__(self, c: np.ndarray, owner: np.ndarray, num_ranks: int):
        n = len(c)
        self.item_at = np.argsort(c, kind="stable")  # ties by index
        self.cost_at = np.append(c[self.item_at], np.inf)
        position_of = np.empty(n, dtype=np.int64)
        position_of[self.item_at] = np.arange(n)
        counts = np.bincount(owner, minlength=num_ranks)
        grouped = np.sort(owner * (n + 1) + position_of)  # by rank, then position
        rank, position = np.divmod(grouped, n + 1)
        column = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        self.position = np.full((num_ranks, int(counts.max())), n, dtype=np.int64)
        self.position[rank, column] = position
        self.loads = np.bincount(owner, weights=c, minlength=num_ranks)

    def swap(self, heavy: np.ndarray, i: np.ndarray, light: np.ndarray, j: np.ndarray) -> None:
        """Swap slot ``i[p]`` of rank ``heavy[p]`` with slot ``j[p]`` of ``light[p]``, for every
        pair p (the ranks of all pairs are distinct), and keep the rows sorted."""
        given, taken = self.position[heavy, i], self.position[light, j]
        delta = self.cost_at[given] - self.cost_at[taken]
        self.position[heavy, i], self.position[light, j] = taken, given
        self.loads[heavy] -= delta
        self.loads[light] += delta
        rows = np.concatenate([heavy, light])
        self.position[rows] = np.sort(self.position[rows], axis=1)

    def owners(self) -> np.ndarray:
        """[B] rank of each item."""
        n = len(self.item_at)
        rank, column = np.nonzero(self.position < n)
        owner = np.empty(n, dtype=np.int64)
        owner[self.item_at[self.position[rank, column]]] = rank
        return owner


def _pairwise_rounds(slots: _RankSlots, target: float, max_rounds: int = 64) -> None:
    """Pair the i-th heaviest rank with the i-th lightest; every pair takes its best swap.

    The pairs are disjoint, so one round fixes up to k/2 ranks in a few numpy
    calls where a top-rank step fixes one. Ends when the max load reaches
    ``target``, no pair improves, or after ``max_rounds``.
    """
    half = len(slots.loads) // 2
    for _ in range(max_rounds):
        by_load = np.argsort(slots.loads, kind="stable")
        if slots.loads[by_load[-1]] <= target:
            return
        heavy, light = by_load[::-1][:half], by_load[:half]
        new_max, i, j = _best_swaps(slots, heavy, light)
        improves = new_max < slots.loads[heavy]
        if not improves.any():
            return
        slots.swap(heavy[improves], i[improves], light[improves], j[improves])


def _top_rank_swaps(slots: _RankSlots, target: float, max_steps: int) -> None:
    """2-opt on the most loaded rank (lowest index on ties): its best swap with any lighter
    rank, until the max load reaches ``target``, no swap lowers it, or ``max_steps``."""
    for _ in range(max_steps):
        top = int(np.argmax(slots.loads))
        if slots.loads[top] <= target:
            return
        light = np.flatnonzero(slots.loads < slots.loads[top])
        if len(light) == 0:
            return
        heavy = np.full(len(light), top)
        new_max, i, j = _best_swaps(slots, heavy, light)
        p = int(np.argmin(new_max))
        if not new_max[p] < slots.loads[top]:
            return
        slots.swap(heavy[p: p + 1], i[p: p + 1], light[p: p + 1], j[p: p + 1])


def _best_swaps(slots: _RankSlots, heavy: np.ndarray, light: np.ndarray):
    """Each pair's best single swap: ``([P] new pair max, [P] slot i, [P] slot j)``.

    For pair p (``heavy[p]`` loaded more than ``light[p]`` by ``gap``) the swap
    of heavy item i with light item j moves ``d = c_i - c_j``; it helps when
    ``0 < d < gap`` and gives the pair the max load
    ``(L_h + L_l) / 2 + |c_j - (c_i - gap / 2)|``. So for each i only the two
    light items around ``c_i - gap / 2`` in cost order can win (the partner
    search of the runtime's former per-rank 2-opt, vectorised over items and
    pairs). Their slots come from two 1-D binary searches: one over all costs
    turns the ideal cost into a global position q, one over the light rows
    laid end to end in disjoint integer bands finds each row's first slot at
    or above q; all exact. The new max is inf where no swap helps. Ties: any
    partner below before any above, then the lowest slot i.
    """
    num_pairs, width = len(heavy), slots.position.shape[1]
    n = len(slots.item_at)
    h_cost = slots.cost_at[slots.position[heavy]]  # [P, w]
    h_load, l_load = slots.loads[heavy][:, None], slots.loads[light][:, None]
    gap = h_load - l_load
    ideal = np.searchsorted(slots.cost_at[:n], h_cost - gap / 2)  # [P, w] positions with cost below
    band = (np.arange(num_pairs) * (n + 1))[:, None]
    rows_end_to_end = (slots.position[light] + band).ravel()
    insert = np.searchsorted(rows_end_to_end, (ideal + band).ravel()).reshape(num_pairs, width)
    insert -= (np.arange(num_pairs) * width)[:, None]
    partner = np.concatenate([insert - 1, insert], axis=1).clip(0, width - 1)  # [P, 2w]: below, above
    l_cost = slots.cost_at[slots.position[light[:, None], partner]]
    with np.errstate(invalid="ignore"):  # inf - inf where both slots are empty
        delta = np.concatenate([h_cost, h_cost], axis=1) - l_cost
        helps = (delta > 0) & (delta < gap)
    new_max = np.where(helps, np.maximum(h_load - delta, l_load + delta), np.inf)
    best = new_max.argmin(axis=1)
    rows = np.arange(num_pairs)
    return new_max[rows, best], best % width, partner[rows, best]


def _refine_by_moves(costs: Sequence[float], bins: Partition, max_steps: int) -> None:
    """Unequal counts: 2-opt (moves and swaps) on the max-loaded rank; mutates ``bins``.

    Stops early once the max load reaches ``lower_bound`` (rounded up when
    all costs are integers): nothing can beat it.
    """
    target = lower_bound(costs, len(bins), equal_counts=False)
    if all(float(c).is_integer() for c in costs):
        target = math.ceil(target)
    loads = [sum(costs[i] for i in b) for b in bins]
    by_cost = [sorted((costs[i], i) for i in b) for b in bins]
    for _ in range(max_steps):
        top = max(range(len(bins)), key=lambda r: (loads[r], -r))
        if loads[top] <= target:
            return
        best = _best_exchange(by_cost, loads, top)
        if best is None:
            return
        _, other, i, j = best
        delta = costs[i] - (costs[j] if j is not None else 0.0)
        _move(by_cost, bins, costs, i, top, other)
        if j is not None:
            _move(by_cost, bins, costs, j, other, top)
        loads[top] -= delta
        loads[other] += delta


def _move(by_cost, bins, costs, item, src, dst) -> None:
    bins[src].remove(item)
    bins[dst].append(item)
    by_cost[src].remove((costs[item], item))
    bisect.insort(by_cost[dst], (costs[item], item))


def _best_exchange(by_cost, loads, top):
    """The swap (top:i <-> other:j) or move (j=None) minimising the pair's new max.

    Returns ``(new_pair_max, other, i, j)`` or None when nothing lowers
    ``loads[top]``. For each i the ideal partner costs ``c_i - gap / 2``;
    bisect finds the nearest candidates. Ranks are visited lightest first and
    the scan stops once ``(load_top + load_other) / 2``, the best any swap
    with that rank can reach, is no better than what was found.
    """
    best = None
    for other in sorted(range(len(loads)), key=lambda r: (loads[r], r)):
        gap = loads[top] - loads[other]
        if gap <= 0 or (best is not None and loads[top] - gap / 2 >= best[0]):
            break
        partners = by_cost[other]
        for cost_i, i in by_cost[top]:
            candidates = [(cost_i, None)] if cost_i < gap else []
            k = bisect.bisect_left(partners, (cost_i - gap / 2, -1))
            candidates += [partners[p] for p in (k - 1, k) if 0 <= p < len(partners)]
            for cost_j_or_delta, j in candidates:
                delta = cost_j_or_delta if j is None else cost_i - cost_j_or_delta
                if not 0 < delta < gap:
                    continue
                new_max = max(loads[top] - delta, loads[other] + delta)
                if best is None or new_max < best[0]:
                    best = (new_max, other, i, j)
    return best


def karmarkar_karp_partition(
    costs: Sequence[float], num_ranks: int, equal_counts: bool = True
) -> Partition:
    """k-way largest differencing method (Karmarkar & Karp 1982).

    Each state is a k-way partial partition. Start: with ``equal_counts``,
    items sorted by cost are cut into consecutive groups of k, each group one
    state with one item per set (the layout verl's ``seqlen_balancing`` uses);
    otherwise every item is a state with one non-empty set. Repeatedly merge
    the two states with the largest spread (max - min set sum), pairing the
    heaviest sets of one with the lightest of the other. When B is not a
    multiple of k, zero-cost placeholders fill the last group and are
    dropped at the end; the bins with more items come first so the counts
    match ``rank_capacities``.

    Returns:
        k lists of sample indices, each sorted ascending.

    Raises:
        ValueError: on ``num_ranks < 1`` or a negative cost.
    """
    _check_costs(costs)
    _check_ranks(num_ranks)
    n = len(costs)
    order = sorted(range(n), key=lambda i: (costs[i], i))
    if equal_counts:
        padded = [None] * (-n % num_ranks) + order
        groups = [padded[s : s + num_ranks] for s in range(0, len(padded), num_ranks)]
    else:
        groups = [[i] + [None] * (num_ranks - 1) for i in order]
    tie = itertools.count()
    heap = [_kk_state(costs, [[i] if i is not None else [] for i in g], tie) for g in groups]
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(num_ranks)]
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heavy_first = sorted(a[2], key=lambda s: (-s[0], s[1]))
        light_first = sorted(b[2], key=lambda s: (s[0], s[1]))
        merged = [x[1] + y[1] for x, y in zip(heavy_first, light_first)]
        heapq.heappush(heap, _kk_state(costs, merged, tie))
    bins = [sorted(s[1]) for s in heap[0][2]]
    bins.sort(key=lambda b: (-len(b), b))
    return bins


def _kk_state(costs, sets, tie):
    """Heap entry (-spread, tiebreak, [(set_sum, set_items)]): pops largest spread first."""
    sums = [(sum(costs[i] for i in s), s) for s in sets]
    spread = max(s for s, _ in sums) - min(s for s, _ in sums)
    return (-spread, next(tie), sums)


def rank_loads(costs: Sequence[float], partition: Partition) -> list[float]:
    """Sum of costs per rank."""
    return [float(sum(costs[i] for i in b)) for b in partition]


def imbalance(costs: Sequence[float], partition: Partition) -> float:
    """max rank load / mean rank load (1.0 is perfect; 1.0 when all costs are 0)."""
    loads = rank_loads(costs, partition)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def lower_bound(costs: Sequence[float], num_ranks: int, equal_counts: bool = True) -> float:
    """A lower bound on the best achievable max rank load.

    Always: ``max(mean load, largest cost)``, and when B > k the pigeonhole
    bound ``c_(k) + c_(k+1)`` (two of the k+1 largest items share a rank).
    With ``equal_counts`` also: the rank holding the largest item holds at
    least ``B // k - 1`` others, each no smaller than the smallest items, so
    ``c_(1) + sum of the B // k - 1 smallest``.

    Raises:
        ValueError: on ``num_ranks < 1`` or a negative cost.
    """
    _check_costs(costs)
    _check_ranks(num_ranks)
    if not costs:
        return 0.0
    desc = sorted(costs, reverse=True)
    bound = max(sum(desc) / num_ranks, desc[0])
    if len(desc) > num_ranks:
        bound = max(bound, desc[num_ranks - 1] + desc[num_ranks])
    if equal_counts:
        others = len(desc) // num_ranks - 1
        if others > 0:
            bound = max(bound, desc[0] + sum(desc[-others:]))
    return float(bound)


def _check_costs(costs: Sequence[float]) -> None:
    for i, c in enumerate(costs):
        if c < 0:
            raise ValueError(f"costs[{i}] = {c} is negative; costs must be >= 0")


def _check_ranks(num_ranks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks} must be >= 1")
