"""Transfer counters: every byte the data plane moves, per rank and per edge.

Pure bookkeeping (no torch). One ``TransferCounters`` per rank; the exchange
functions record into it and the metrics exporter reads ``as_metrics()``.
Node-level totals come from ``merge`` over the ranks of a node.

Conventions (all in bytes):
- *sent* / *received*: payload leaving / arriving at this rank by any path;
  what stays on the rank (local cache) is never counted.
- *handed over*: the part of *sent* that went through the node buffer
  (shared memory) instead of the network.
- *intra-node* / *cross-node*: *sent* split by whether the peer is on the
  same node; cross-node bytes are also kept per (src node, dst node) pair.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

UNNAMED_EDGE = "unnamed"


@dataclass
class TransferCounters:
    """Bytes moved by one rank (or, after ``merge``, a set of ranks).

    Args:
        node_of_rank: node index of every global rank; None = every rank is
            its own node (all traffic counts as cross-node).
    """

    node_of_rank: Sequence[int] | None = None
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_handed_over: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Non-empty pieces sent, per edge."""
    exchanges: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cache_hits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Exchanges whose plan moved zero bytes anywhere in the group, per edge."""
    intra_node_bytes: int = 0
    cross_node_bytes: int = 0
    node_pair_bytes: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    """(src node, dst node) -> cross-node bytes sent."""

    @classmethod
    def for_plan(cls, plan, world_size: int) -> "TransferCounters":
        """Fresh counters for a rank of a world of ``world_size`` ranks laid out by ``plan``
        (``distflow.planner.Plan``: its ``node_of_rank``)."""
        return cls(node_of_rank=[plan.node_of_rank(r) for r in range(world_size)])

    def node_of(self, rank: int) -> int:
        return rank if self.node_of_rank is None else self.node_of_rank[rank]

    def record_send(self, edge: str, src: int, dst: int, nbytes: int, handed_over: bool = False) -> None:
        """One piece of ``nbytes`` from global rank ``src`` to ``dst`` (src != dst)."""
        if nbytes <= 0:
            return
        edge = edge or UNNAMED_EDGE
        self.bytes_sent[edge] += nbytes
        self.messages[edge] += 1
        if handed_over:
            self.bytes_handed_over[edge] += nbytes
        src_node, dst_node = self.node_of(src), self.node_of(dst)
        if src_node == dst_node:
            self.intra_node_bytes += nbytes
        else:
            self.cross_node_bytes += nbytes
            self.node_pair_bytes[(src_node, dst_node)] += nbytes

    def record_receive(self, edge: str, nbytes: int) -> None:
        if nbytes > 0:
            self.bytes_received[edge or UNNAMED_EDGE] += nbytes

    def record_exchange(self, edge: str, cache_hit: bool) -> None:
        """Call once per exchange; ``cache_hit`` when the whole group moved zero bytes."""
        edge = edge or UNNAMED_EDGE
        self.exchanges[edge] += 1
        if cache_hit:
            self.cache_hits[edge] += 1

    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    def total_received(self) -> int:
        return sum(self.bytes_received.values())

    def merge(self, other: "TransferCounters") -> "TransferCounters":
        """A new counter holding the sums of both (e.g. all ranks of a node)."""
        out = TransferCounters(node_of_rank=self.node_of_rank)
        for name in ("bytes_sent", "bytes_received", "bytes_handed_over", "messages",
                     "exchanges", "cache_hits", "node_pair_bytes"):
            for src in (self, other):
                for key, value in getattr(src, name).items():
                    getattr(out, name)[key] += value
        out.intra_node_bytes = self.intra_node_bytes + other.intra_node_bytes
        out.cross_node_bytes = self.cross_node_bytes + other.cross_node_bytes
        return out

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        """Flat metrics: ``<prefix>bytes_sent/<edge>``, ``<prefix>bytes_sent`` (total),
        same for bytes_received, bytes_handed_over, messages, exchanges, cache_hits;
        ``<prefix>intra_node_bytes``, ``<prefix>cross_node_bytes`` and
        ``<prefix>node_pair_bytes/<src>_to_<dst>``."""
        out: dict[str, float] = {}
        for name in ("bytes_sent", "bytes_received", "bytes_handed_over", "messages",
                     "exchanges", "cache_hits"):
            per_edge = getattr(self, name)
            out[f"{prefix}{name}"] = float(sum(per_edge.values()))
            for edge, value in sorted(per_edge.items()):
                out[f"{prefix}{name}/{edge}"] = float(value)
        out[f"{prefix}intra_node_bytes"] = float(self.intra_node_bytes)
        out[f"{prefix}cross_node_bytes"] = float(self.cross_node_bytes)
        for (src, dst), value in sorted(self.node_pair_bytes.items()):
            out[f"{prefix}node_pair_bytes/{src}_to_{dst}"] = float(value)
        return out
