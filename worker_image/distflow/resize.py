"""The worker's side of a resize: stop at a step boundary when the operator asks.

The operator writes the size it wants into the key ``resize`` of the job's ConfigMap,
which every node pod sees as the file ``/etc/distflow/resize`` (JSON
``{"numNodes": N}``). At each step boundary, after the step's checkpoint, the
workers read it; when it names a size other than the gang's, they all stop at that
same boundary and exit with ``EXIT_RESIZE``, which the operator reads as a resize
(a new attempt at the new size, not a failure). A ConfigMap update reaches the nodes
at different moments, so the ranks agree first: one that has seen the request makes
every rank stop (``agree`` is a max-reduction over the ranks).

A request with ``"inPlace": true`` (what the operator writes for a job without pools) resizes the
gang in place (``distflow.gang_resize``): the running workers re-form the world with the new
size at a step boundary (new nodes join, the last ones leave), and nothing exits but the leavers.

With pools (``async.enable``) the request may also name the rollout pool's size,
``{"numNodes": N, "rolloutNodes": R}``. When the trainer nodes (N - R) are those of
the running gang, it is an in-place resize of the rollout pool
(``distflow.pools.elastic``): the gang does not stop, and ``ResizeWatch`` leaves it alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

EXIT_RESIZE = 3
"""Exit code of a worker that stopped at a step boundary for a resize (checkpoint saved)."""

EXIT_LEFT_POOL = 4
"""Exit code of a worker that left in an in-place shrink, of its rollout pool (``distflow.pools.elastic``)
or of its gang (``distflow.gang_resize``): the others go on without it; its pod is deleted, not restarted."""

class StoppedForResize(Exception):
    """This node's workers stopped at a step boundary for a resize, checkpoint saved: the node
    exits with ``EXIT_RESIZE``."""


class LeftPool(Exception):
    """This node's rollout workers left the pool in an in-place shrink: the node exits with
    ``EXIT_LEFT_POOL`` and the others go on without it."""


JOIN_ENV = "DISTFLOW_JOIN"
"""Environment variable of a pod whose workers join the running job ("1"): its rollout pool
(``distflow.pools.elastic``), or its gang (``distflow.gang_resize``, a job without pools)."""

RESIZE_KEY = "resize"
"""Key of the job's ConfigMap (and file name in the mounted spec directory)."""


@dataclass(frozen=True)
class ResizeRequest:
    """What the operator asks for: the gang's node count and, with pools, the rollout pool's."""

    num_nodes: int
    """cluster.numNodes wanted (>= 1)."""
    rollout_nodes: int | None = None
    """async.rolloutPool.numNodes wanted (>= 1, < ``num_nodes``); None: not named."""
    in_place: bool = False
    """Resize the whole gang in place (``"inPlace": true``; ``distflow.gang_resize``), not by a stop."""

    def in_place_for(self, num_nodes: int, rollout_nodes: int | None) -> bool:
        """Whether this is an in-place resize of the rollout pool of a gang of ``num_nodes`` nodes,
        ``rollout_nodes`` of them generating (None: no pools): it names the rollout pool's size and
        keeps the trainer nodes. (A request for the running sizes is in place, and changes nothing.)"""
        return (rollout_nodes is not None and self.rollout_nodes is not None
                and self.num_nodes - self.rollout_nodes == num_nodes - rollout_nodes)


def _count(value: object, least: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= least else None


def read_request(path: Path) -> ResizeRequest | None:
    """The request in the file, or None when there is no readable request.

    A missing, empty or half-written file is no request (the next boundary reads it again); so is
    one whose ``numNodes`` is not a whole number >= 1. A ``rolloutNodes`` that is not a whole number
    in [1, numNodes - 1] is ignored (the request is one for the whole gang).
    """
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or (nodes := _count(value.get("numNodes"), 1)) is None:
        return None
    rollout = _count(value.get("rolloutNodes"), 1)
    return ResizeRequest(nodes, rollout if rollout is not None and rollout < nodes else None,
                         value.get("inPlace") is True)


def requested_nodes(path: Path) -> int | None:
    """The node count the operator asks for, or None when there is no readable request (``read_request``)."""
    request = read_request(path)
    return request.num_nodes if request is not None else None


class ResizeWatch:
    """Polled at each step boundary: should the gang stop for a resize?

    Args:
        path: the mounted request file (``<spec dir>/resize``).
        num_nodes: the gang's size (cluster.numNodes of this attempt).
        agree: reduces a 0/1 flag to its maximum over every rank (an all-reduce); the
            identity for a single process.
        rollout_nodes: the rollout pool's nodes (async.rolloutPool.numNodes); None: no pools. A
            request that is in place for it (``ResizeRequest.in_place_for``) does not stop the gang.
        gang_in_place: the gang resizes in place (``distflow.gang_resize``, a job without pools): an
            ``inPlace`` request does not stop it.
    """

    def __init__(self, path: Path | str, num_nodes: int, agree: Callable[[int], int] = lambda flag: flag,
                 rollout_nodes: int | None = None, gang_in_place: bool = False):
        self.path, self.num_nodes, self.agree = Path(path), num_nodes, agree
        self.rollout_nodes, self.gang_in_place = rollout_nodes, gang_in_place
        self.requested: int | None = None
        """The size this rank last read (None: no request, or one this rank has not seen yet)."""

    def should_stop(self) -> bool:
        """True on every rank once any rank has seen a request for another size that is not an
        in-place resize of the rollout pool (collective: every rank calls it at the same step boundary)."""
        request = read_request(self.path)
        self.requested = request.num_nodes if request is not None else None
        stop = request is not None and request.num_nodes != self.num_nodes \
            and not request.in_place_for(self.num_nodes, self.rollout_nodes) \
            and not (request.in_place and self.gang_in_place)
        return bool(self.agree(int(stop)))
