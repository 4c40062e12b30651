"""DAPO dynamic sampling (Yu et al. 2025): keep prompt groups whose scores differ.

A group whose responses all score the same has zero group-relative advantage
(GRPO, RLOO, ...): it only dilutes the token-mean loss. Dynamic sampling drops
such groups and refills the batch from further rollouts. Here the batch is
spread over rollout dp ranks, so after the last round every rank must pick the
same global set of groups and end with the same number of them:

    round 0..k on every rank  ->  candidates per rank (has signal?, round)
    plan_group_selection      ->  the first ``num_groups`` candidates in a global
                                  order, then each rank keeps its own up to its
                                  quota and surplus groups move to ranks short of it

Both functions are pure; every rank computes the same plan from all-gathered
candidate metadata, as for load balancing.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def groups_with_signal(scores: Tensor, group_index: Tensor) -> Tensor:
    """Which samples belong to a group whose scores are not all equal.

    Args:
        scores: [B] sequence scores.
        group_index: [B] int64 prompt-group id of each sample.

    Returns:
        [B] bool, True for every sample of a group with max score > min score
        (a group of one sample has no signal).
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    scores = scores.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=scores.device).scatter_reduce(
        0, inverse, scores, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=scores.device).scatter_reduce(
        0, inverse, scores, "amin")
    return (high > low)[inverse]


def plan_group_selection(candidates: Sequence[Sequence[tuple[bool, int]]], num_groups: int) -> list[list[int]]:
    """Pick ``num_groups`` groups over all ranks and spread them evenly.

    Candidates are ordered globally by (no signal after signal, earlier round
    first, position among the rank's candidates of that kind and round, rank):
    groups with signal come first, interleaved over ranks round by round, and
    groups without signal only fill what is left. Each rank then keeps its own
    selected groups up to its quota ``num_groups / num_ranks``; the surplus, in
    rank-then-local order, goes to the ranks short of their quota in rank order.

    Args:
        candidates: per rank, its candidate groups in local order as
            (has_signal, round).
        num_groups: groups in the step's batch (data.trainBatchSize).

    Returns:
        Per rank, the global ids of the groups it ends with (candidates numbered
        in rank-then-local order), its own first, each list of length
        ``num_groups / num_ranks``.

    Raises:
        ValueError: ``num_groups`` is not a multiple of the number of ranks, or
            exceeds the number of candidates.
    """
    num_ranks = len(candidates)
    total = sum(len(c) for c in candidates)
    if num_ranks == 0 or num_groups % num_ranks or num_groups > total:
        raise ValueError(f"plan_group_selection: {num_groups} groups cannot be split evenly over "
                         f"{num_ranks} ranks from {total} candidates")
    keyed, offset = [], 0
    for rank, groups in enumerate(candidates):
        seen: dict[tuple[bool, int], int] = {}
        for pos, (signal, rnd) in enumerate(groups):
            kind = (signal, rnd)
            seen[kind] = seen.get(kind, -1) + 1
            keyed.append(((not signal, rnd, seen[kind], rank), rank, offset + pos))
        offset += len(groups)
    chosen = sorted(keyed)[:num_groups]
    selected: list[list[int]] = [[] for _ in range(num_ranks)]
    for _, rank, gid in sorted(chosen, key=lambda item: item[2]):
        selected[rank].append(gid)
    quota = num_groups // num_ranks
    surplus = [gid for held in selected for gid in held[quota:]]
    target = [held[:quota] for held in selected]
    for held in target:
        need = quota - len(held)
        held.extend(surplus[:need])
        del surplus[:need]
    return target
