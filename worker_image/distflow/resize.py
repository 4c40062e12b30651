"""The worker's side of a resize: stop at a step boundary when the operator asks.

The operator writes the size it wants into the key ``resize`` of the job's ConfigMap,
which every node pod sees as the file ``/etc/distflow/resize`` (JSON
``{"numNodes": N}``). At each step boundary, after the step's checkpoint, the
workers read it; when it names a size other than the gang's, they all stop at that
same boundary and exit with ``EXIT_RESIZE``, which the operator reads as a resize
(a new attempt at the new size, not a failure). A ConfigMap update reaches the nodes
at different moments, so the ranks agree first: one that has seen the request makes
every rank stop (``agree`` is a max-reduction over the ranks).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

EXIT_RESIZE = 3
"""Exit code of a worker that stopped at a step boundary for a resize (checkpoint saved)."""

class StoppedForResize(Exception):
    """This node's workers stopped at a step boundary for a resize, checkpoint saved: the node
    exits with ``EXIT_RESIZE``."""


RESIZE_KEY = "resize"
"""Key of the job's ConfigMap (and file name in the mounted spec directory)."""


def requested_nodes(path: Path) -> int | None:
    """The node count the operator asks for, or None when there is no readable request.

    A missing, empty or half-written file is no request (the next boundary reads it again).
    """
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    nodes = value.get("numNodes") if isinstance(value, dict) else None
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else None


class ResizeWatch:
    """Polled at each step boundary: should the gang stop for a resize?

    Args:
        path: the mounted request file (``<spec dir>/resize``).
        num_nodes: the gang's size (cluster.numNodes of this attempt).
        agree: reduces a 0/1 flag to its maximum over every rank (an all-reduce); the
            identity for a single process.
    """

    def __init__(self, path: Path | str, num_nodes: int, agree: Callable[[int], int] = lambda flag: flag):
        self.path, self.num_nodes, self.agree = Path(path), num_nodes, agree
        self.requested: int | None = None
        """The size this rank last read (None: no request, or one this rank has not seen yet)."""

    def should_stop(self) -> bool:
        """True on every rank once any rank has seen a request for another size (collective: every
        rank calls it at the same step boundary)."""
        self.requested = requested_nodes(self.path)
        return bool(self.agree(int(self.requested is not None and self.requested != self.num_nodes)))
