"""Redistribution plans: which sample goes from which rank to which.

Pure and deterministic (no torch): every rank builds the same plan from the
same metadata and then executes its own row of it (``distflow.data.exchange``).
This is DistFlow's data coordinator without a coordinator (arXiv 2507.13833):
the plan replaces the driver that would otherwise gather and scatter the batch.

Samples are named by *global ids* (ints unique within a step). A *layout* is a
list, per rank of the process group, of the ids that rank holds, in local
order; ranks outside a stage's layout hold ``[]``.

``RedistributionPlan`` is the whole [N][N] plan (the reference, and what the
centralized baseline's root needs). A rank that runs ``exchange`` only needs
its send row and receive column: ``plan_for_rank`` builds that ``RankPlan``
in O(B + N) instead of O(B + N^2), which is what keeps per-edge planning in
milliseconds at hundreds of ranks (docs/benchmarks.md, "The balancer").
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from distflow.data.balance import balance_partition

PerSample = Union[Mapping[int, float], Sequence[float]]
"""A value per global id: ``values[id]``."""


@dataclass(frozen=True)
class RedistributionPlan:
    """Who sends what to whom; identical on every rank."""

    src_holdings: tuple[tuple[int, ...], ...]
    """[N] per source rank: global ids it holds, in local order."""
    dst_assignment: tuple[tuple[int, ...], ...]
    """[N] per destination rank: global ids it must end with, in planned order."""
    sends: tuple[tuple[tuple[int, ...], ...], ...]
    """[N][N] ``sends[src][dst]``: positions in src's local batch going to dst,
    in dst's planned order. ``sends[r][r]`` is what stays on r."""
    recv_order: tuple[tuple[int, ...], ...]
    """[N] ``recv_order[dst][k]``: index of dst's k-th planned sample in the
    concatenation of the pieces dst gets from src 0, 1, ..., N-1."""

    @property
    def num_ranks(self) -> int:
        return len(self.src_holdings)

    @property
    def is_identity(self) -> bool:
        """Every sample stays on its rank in the same order: zero bytes move (local cache)."""
        return self.src_holdings == self.dst_assignment

    def recv_segments(self, dst: int) -> tuple[tuple[int, int, int], ...]:
        """dst's planned order as runs ``(src, start, stop)`` of the piece from src.

        Concatenating ``piece_from[src][start:stop]`` over the runs gives dst's
        samples in planned order; fewer runs means fewer copies.
        """
        return _segments([len(row[dst]) for row in self.sends], self.recv_order[dst])

    def for_rank(self, rank: int) -> RankPlan:
        """``rank``'s part of this plan (what ``exchange`` runs on that rank).

        Raises:
            ValueError: ``rank`` outside 0..N-1.
        """
        _check_rank(rank, self.num_ranks)
        destinations = [[0] * len(held) for held in self.src_holdings]
        for src, row in enumerate(self.sends):
            for dst, positions in enumerate(row):
                for pos in positions:
                    destinations[src][pos] = dst
        return RankPlan(
            rank=rank,
            sends=self.sends[rank],
            receives=tuple(row[rank] for row in self.sends),
            recv_order=self.recv_order[rank],
            destinations=tuple(tuple(d) for d in destinations),
            is_identity=self.is_identity,
        )

    def bytes_matrix(self, sample_nbytes: PerSample) -> list[list[int]]:
        """[N][N] bytes from src (row) to dst (column); ``sample_nbytes[id]`` in bytes.

        The diagonal is what stays in place and moves nothing.
        """
        return [
            [
                sum(int(sample_nbytes[self.src_holdings[src][p]]) for p in self.sends[src][dst])
                for dst in range(self.num_ranks)
            ]
            for src in range(self.num_ranks)
        ]

    def num_moved_samples(self) -> int:
        """Samples that change rank."""
        return sum(
            len(self.sends[s][d]) for s in range(self.num_ranks) for d in range(self.num_ranks) if s != d
        )


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a ``RedistributionPlan``: its send row, its receive column and
    what every rank must agree on; identical to ``RedistributionPlan.for_rank(rank)``."""

    rank: int
    """The group rank this part is for."""
    sends: tuple[tuple[int, ...], ...]
    """[N] ``sends[dst]``: positions in this rank's local batch going to dst, in
    dst's planned order (``RedistributionPlan.sends[rank]``)."""
    receives: tuple[tuple[int, ...], ...]
    """[N] ``receives[src]``: positions in src's local batch coming to this rank,
    in this rank's planned order (``RedistributionPlan.sends[src][rank]``)."""
    recv_order: tuple[int, ...]
    """This rank's ``RedistributionPlan.recv_order``."""
    destinations: tuple[tuple[int, ...], ...]
    """[N][B_src] ``destinations[src][p]``: the rank src's p-th sample goes to.
    Group-wide, O(B): every rank decides from it whether any rank moves bytes."""
    is_identity: bool
    """Every sample stays on its rank in the same order: zero bytes move."""

    @property
    def num_ranks(self) -> int:
        return len(self.destinations)

    @property
    def src_counts(self) -> list[int]:
        """[N] samples each rank holds before the move."""
        return [len(d) for d in self.destinations]

    def recv_segments(self) -> tuple[tuple[int, int, int], ...]:
        """This rank's planned order as runs ``(src, start, stop)`` of the piece from src
        (``RedistributionPlan.recv_segments(rank)``)."""
        return _segments([len(r) for r in self.receives], self.recv_order)


def plan_redistribution(
    src_holdings: Sequence[Sequence[int]], dst_assignment: Sequence[Sequence[int]]
) -> RedistributionPlan:
    """Plan moving samples from ``src_holdings`` to ``dst_assignment``; O(B + N^2).

    Args:
        src_holdings: [N] per rank, the global ids it holds, in local order.
        dst_assignment: [N] per rank, the global ids it must get, in order.

    Raises:
        ValueError: if the two have different lengths, an id is held twice,
            assigned twice, assigned but held by nobody, or held but assigned
            to nobody (every sample is delivered exactly once).
    """
    num_ranks = len(src_holdings)
    sends = [[[] for _ in range(num_ranks)] for _ in range(num_ranks)]
    pieces = []
    for dst, src, pos in _routes(src_holdings, dst_assignment):
        pieces.append((dst, src, len(sends[src][dst])))
        sends[src][dst].append(pos)
    return RedistributionPlan(
        src_holdings=tuple(tuple(h) for h in src_holdings),
        dst_assignment=tuple(tuple(a) for a in dst_assignment),
        sends=tuple(tuple(tuple(p) for p in row) for row in sends),
        recv_order=_recv_order(pieces, sends, num_ranks),
    )


def plan_for_rank(
    src_holdings: Sequence[Sequence[int]], dst_assignment: Sequence[Sequence[int]], rank: int
) -> RankPlan:
    """``plan_redistribution(src_holdings, dst_assignment).for_rank(rank)`` in O(B + N).

    Validates like ``plan_redistribution`` (the whole plan, so every rank
    raises the same error) but keeps only ``rank``'s row and column.

    Raises:
        ValueError: as ``plan_redistribution``, or ``rank`` outside 0..N-1.
    """
    num_ranks = len(src_holdings)
    _check_rank(rank, num_ranks)
    sends: list[list[int]] = [[] for _ in range(num_ranks)]
    receives: list[list[int]] = [[] for _ in range(num_ranks)]
    destinations = [[0] * len(held) for held in src_holdings]
    pieces = []
    for dst, src, pos in _routes(src_holdings, dst_assignment):
        destinations[src][pos] = dst
        if src == rank:
            sends[dst].append(pos)
        if dst == rank:
            pieces.append((src, len(receives[src])))
            receives[src].append(pos)
    offsets = list(itertools.accumulate((len(r) for r in receives), initial=0))
    return RankPlan(
        rank=rank,
        sends=tuple(tuple(p) for p in sends),
        receives=tuple(tuple(p) for p in receives),
        recv_order=tuple(offsets[src] + k for src, k in pieces),
        destinations=tuple(tuple(d) for d in destinations),
        is_identity=all(tuple(h) == tuple(a) for h, a in zip(src_holdings, dst_assignment)),
    )


def _check_rank(rank: int, num_ranks: int) -> None:
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank = {rank} must be in 0..{num_ranks - 1} (one entry per rank of the group)")


def _routes(src_holdings, dst_assignment):
    """Yield ``(dst, src, position in src)`` for every assigned sample, in planned order.

    Raises (when the offending entry is reached, or at the end for samples
    assigned to nobody) the ``ValueError`` s that ``plan_redistribution`` documents.
    """
    if len(src_holdings) != len(dst_assignment):
        raise ValueError(
            f"src_holdings has {len(src_holdings)} ranks but dst_assignment has "
            f"{len(dst_assignment)}; give one list per rank of the group (empty for idle ranks)"
        )
    owner = _owners(src_holdings)
    assigned: dict[int, int] = {}
    for dst, ids in enumerate(dst_assignment):
        for gid in ids:
            if gid not in owner:
                raise ValueError(f"dst_assignment[{dst}] has sample id {gid} that no rank holds")
            if gid in assigned:
                raise ValueError(
                    f"sample id {gid} is assigned to rank {assigned[gid]} and again to rank {dst}"
                )
            assigned[gid] = dst
            yield (dst, *owner[gid])
    if len(assigned) < len(owner):
        missing = sorted(set(owner) - set(assigned))
        raise ValueError(
            f"sample ids {missing[:10]} are held but assigned to no rank; "
            "dst_assignment must cover every held sample exactly once"
        )


def _segments(piece_lengths: Sequence[int], recv_order: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(src, start, stop)`` over the concatenated pieces, in ``recv_order``."""
    offsets = list(itertools.accumulate(piece_lengths, initial=0))
    runs: list[list[int]] = []
    for index in recv_order:
        src = bisect.bisect_right(offsets, index) - 1
        pos = index - offsets[src]
        if runs and runs[-1][0] == src and runs[-1][2] == pos:
            runs[-1][2] += 1
        else:
            runs.append([src, pos, pos + 1])
    return tuple(tuple(r) for r in runs)


def _owners(src_holdings: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    owner: dict[int, tuple[int, int]] = {}
    for src, ids in enumerate(src_holdings):
        for pos, gid in enumerate(ids):
            if gid in owner:
                raise ValueError(
                    f"sample id {gid} is held by rank {owner[gid][0]} and rank {src}; ids must be unique"
                )
            owner[gid] = (src, pos)
    return owner


def _recv_order(pieces, sends, num_ranks) -> tuple[tuple[int, ...], ...]:
    """Map (dst, src, index within piece) entries, in planned order, to concat indices."""
    offsets = [list(itertools.accumulate((len(sends[s][d]) for s in range(num_ranks)), initial=0))
               for d in range(num_ranks)]
    order: list[list[int]] = [[] for _ in range(num_ranks)]
    for dst, src, k in pieces:
        order[dst].append(offsets[dst][src] + k)
    return tuple(tuple(o) for o in order)


def balanced_assignment(
    src_holdings: Sequence[Sequence[int]],
    costs: PerSample,
    num_ranks: int | None = None,
    *,
    equal_counts: bool = True,
    sample_nbytes: PerSample | None = None,
) -> list[list[int]]:
    """Balance all held samples over ``num_ranks`` ranks, keeping as many in place as possible.

    1. Partition the samples (in rank-then-local order) by ``costs[id]`` with
       ``balance.balance_partition``; bins are the balanced loads.
       If the current layout's max load is already no higher (and, with
       ``equal_counts``, its counts differ by at most one), keep it: the plan
       is the identity and nothing moves.
    2. Otherwise give bins to ranks greedily by overlap: repeatedly take the (bin, rank)
       pair with the most bytes already on that rank (ties: lower bin, then
       lower rank), so an already balanced layout maps onto itself and the
       plan becomes the identity. Leftover bins go to leftover ranks in order.
       Only pairs that share samples (at most B) are scored, so this costs
       O(B log B), not O(k^2 log k) for all pairs; the result is the same
       because pairs with no overlap, taken last in (bin, rank) order, give
       each leftover bin the lowest leftover rank.

    Within a bin, samples keep rank-then-local order, so a rank that keeps
    its own samples keeps them in its order.

    Args:
        src_holdings: [N] per rank, global ids held, in local order.
        costs: cost per global id (``balance.sample_cost`` of its tokens).
        num_ranks: destination ranks 0..num_ranks-1 (default N); the rest get ``[]``.
        equal_counts: passed to ``balance_partition``.
        sample_nbytes: non-negative bytes per global id used to score overlap
            (default: costs, as bytes grow with tokens).

    Returns:
        [N] per destination rank, global ids in planned order.

    Raises:
        ValueError: ``num_ranks`` outside 1..N, or a negative cost.
    """
    group_size = len(src_holdings)
    num_ranks = group_size if num_ranks is None else num_ranks
    if not 1 <= num_ranks <= group_size:
        raise ValueError(f"num_ranks = {num_ranks} must be in 1..{group_size} (the group size)")
    ids = [gid for held in src_holdings for gid in held]
    holder = {gid: src for src, held in enumerate(src_holdings) for gid in held}
    bins = balance_partition([costs[g] for g in ids], num_ranks, equal_counts=equal_counts)
    if _keeps_up(src_holdings, costs, bins, num_ranks, equal_counts):
        return [list(held) for held in src_holdings]
    bins_ids = [[ids[i] for i in sorted(b)] for b in bins]
    weight = costs if sample_nbytes is None else sample_nbytes
    overlap: dict[tuple[int, int], float] = {}  # (bin, rank) -> bytes of the bin already there
    for b, members in enumerate(bins_ids):
        for gid in members:
            if holder[gid] < num_ranks:
                key = (b, holder[gid])
                overlap[key] = overlap.get(key, 0.0) + float(weight[gid])
    rank_of_bin: dict[int, int] = {}
    taken: set[int] = set()
    for (b, r), score in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if score > 0 and b not in rank_of_bin and r not in taken:
            rank_of_bin[b] = r
            taken.add(r)
    free = iter(r for r in range(num_ranks) if r not in taken)
    for b in range(len(bins_ids)):
        if b not in rank_of_bin:
            rank_of_bin[b] = next(free)
    assignment: list[list[int]] = [[] for _ in range(group_size)]
    for b, r in rank_of_bin.items():
        assignment[r] = bins_ids[b]
    return assignment


def _keeps_up(src_holdings, costs, bins, num_ranks: int, equal_counts: bool) -> bool:
    """True when the current layout is already as balanced as ``bins``: then nothing moves."""
    if any(src_holdings[r] for r in range(num_ranks, len(src_holdings))):
        return False
    counts = [len(src_holdings[r]) for r in range(num_ranks)]
    if equal_counts and max(counts) - min(counts) > 1:
        return False
    current = max(sum(costs[g] for g in src_holdings[r]) for r in range(num_ranks))
    ids = [gid for held in src_holdings for gid in held]
    balanced = max(sum(costs[ids[i]] for i in b) for b in bins)
    return current <= balanced


def plan_digest(target: Sequence[Sequence[int]]) -> int:
    """A nonzero 62-bit digest of ``target`` (the global sample ids each rank is to hold, in order):
    equal exactly when two ranks computed the same plan."""
    text = ";".join(",".join(map(str, ids)) for ids in target)
    return (int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2) + 1
