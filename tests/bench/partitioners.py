"""Partitioners only the balancer benchmark compares against (not used by the runtime).

``contiguous_partition`` is "no balancing": consecutive index ranges, the
baseline ``distflow.data.balance.balance_partition`` is measured against.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from distflow.data.balance import Partition, rank_capacities


def contiguous_partition(
    costs: Sequence[float], num_ranks: int, equal_counts: bool = True
) -> Partition:
    """No balancing: consecutive index ranges, the baseline to compare against.

    With ``equal_counts`` rank ``r`` gets the next ``rank_capacities(B, k)[r]``
    indices. Otherwise item i goes to the rank whose share of the total cost
    contains the midpoint of i's cumulative cost.

    Raises:
        ValueError: on ``num_ranks < 1`` or a negative cost.
    """
    if num_ranks < 1 or any(c < 0 for c in costs):
        raise ValueError(f"need num_ranks >= 1 and costs >= 0, got {num_ranks} ranks")
    if equal_counts:
        it = iter(range(len(costs)))
        return [list(itertools.islice(it, c)) for c in rank_capacities(len(costs), num_ranks)]
    bins: Partition = [[] for _ in range(num_ranks)]
    total = float(sum(costs))
    before = 0.0
    for i, c in enumerate(costs):
        mid = before + c / 2
        r = min(int(mid * num_ranks / total), num_ranks - 1) if total > 0 else 0
        bins[r].append(i)
        before += c
    return bins
