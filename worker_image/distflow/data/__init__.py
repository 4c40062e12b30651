"""The data plane: balancing, redistribution plans, exchange and step buffers.

Torch-free at import: the pure parts (``balance``, ``redistribute``,
``counters``) are imported here; ``batch``, ``exchange`` and ``buffer`` need
torch and are imported from their modules, e.g.
``from distflow.data.batch import PackedBatch``.
"""

from distflow.data.balance import (
    balance_partition,
    imbalance,
    karmarkar_karp_partition,
    lower_bound,
    rank_capacities,
    rank_loads,
    sample_cost,
)
from distflow.data.counters import TransferCounters
from distflow.data.redistribute import RedistributionPlan, balanced_assignment, plan_redistribution

__all__ = [
    "RedistributionPlan",
    "TransferCounters",
    "balance_partition",
    "balanced_assignment",
    "imbalance",
    "karmarkar_karp_partition",
    "lower_bound",
    "plan_redistribution",
    "rank_capacities",
    "rank_loads",
    "sample_cost",
]
