"""The centralized baseline: every edge through one root rank, as a single-controller system does.

DistFlow's comparison (arXiv 2507.13833): every rank's whole batch goes to the
root, which reorders and sends each rank its part (``dataPlane.mode:
centralized``). It returns the same batches, bit for bit, as
``distflow.data.exchange.exchange``; it exists to measure against.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from distflow.data.batch import PackedBatch
from distflow.data.counters import TransferCounters
from distflow.data.exchange import EdgeMetadata, check_inputs, checked_lengths, global_rank
from distflow.data.redistribute import RedistributionPlan
from distflow.data.wire import assemble, pack, piece_nbytes, planned_lengths, unpack
from distflow.process_group import wire_device


def exchange_centralized(
    batch: PackedBatch,
    plan: RedistributionPlan,
    group=None,
    counters: TransferCounters | None = None,
    edge: str = "",
    *,
    all_lengths: Sequence[torch.Tensor] | None = None,
    metadata: EdgeMetadata | None = None,
    root: int = 0,
) -> PackedBatch:
    """The single-controller baseline: the same result as ``exchange``, all through ``root``.

    Every other rank sends its whole batch to ``root`` (point-to-point, exact
    sizes); ``root`` materialises every destination's batch in planned order
    and sends it back. Identity plans are routed too, as a driver would.
    Counters: ``root`` records all it receives and sends; others their one
    send and one receive.

    Args/Raises: as ``exchange``; ``plan`` must be the whole ``RedistributionPlan``
    (the root rebuilds every rank's batch), else ``ValueError``.
    """
    if not isinstance(plan, RedistributionPlan):
        raise ValueError("exchange_centralized needs the whole RedistributionPlan (plan_redistribution), "
                         f"not {type(plan).__name__}: its root rebuilds every rank's batch")
    check_inputs(batch, plan, group, None, None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    schema, lengths = checked_lengths(batch, [len(h) for h in plan.src_holdings], group, all_lengths,
                                       metadata)
    device = wire_device(group)
    planned = [planned_lengths(plan, lengths, dst) for dst in range(world)]
    inbound = [piece_nbytes(schema, sum(lens), len(lens)) for lens in lengths]
    outbound = [piece_nbytes(schema, sum(lens), len(lens)) for lens in planned]
    root_global = global_rank(group, root)
    if rank == root:
        result = _centralized_root(batch, plan, schema, lengths, inbound, outbound, group, device, root)
    else:
        if inbound[rank]:
            whole = pack(batch, range(batch.num_samples), schema, inbound[rank], device)
            dist.send(whole, dst=root_global, group=group)
        buffer = torch.empty(outbound[rank], dtype=torch.uint8, device=device)
        if outbound[rank]:
            dist.recv(buffer, src=root_global, group=group)
        result = unpack(buffer, schema, planned[rank])
    if counters is not None:
        _count_centralized(counters, edge, rank, root, inbound, outbound)
    return result


def _count_centralized(counters, edge, rank, root, inbound, outbound) -> None:
    others = [r for r in range(len(inbound)) if r != root]
    if rank == root:
        for peer in others:
            counters.record_receive(edge, inbound[peer])
            counters.record_send(edge, root, peer, outbound[peer])
    else:
        counters.record_send(edge, rank, root, inbound[rank])
        counters.record_receive(edge, outbound[rank])
    moved = sum(inbound[r] + outbound[r] for r in others)
    counters.record_exchange(edge, cache_hit=moved == 0)


def _centralized_root(batch, plan, schema, lengths, inbound, outbound, group, device, root):
    """Receive every batch, rebuild each destination's batch, send them; returns root's own."""
    world = len(lengths)
    buffers, requests = {}, []
    for src in range(world):
        if src != root and inbound[src]:
            buffers[src] = torch.empty(inbound[src], dtype=torch.uint8, device=device)
            requests.append(dist.irecv(buffers[src], src=global_rank(group, src), group=group))
    for request in requests:
        request.wait()
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    full = {src: batch if src == root else unpack(buffers.get(src, empty), schema, lengths[src])
            for src in range(world)}
    result, sends = None, []
    for dst in range(world):
        sources = {src: (full[src], plan.sends[src][dst]) for src in range(world)}
        part = assemble(plan.recv_segments(dst), sources, schema, device)
        if dst == root:
            result = part
        elif outbound[dst]:
            out = pack(part, range(part.num_samples), schema, outbound[dst], device)
            sends.append((out, dist.isend(out, dst=global_rank(group, dst), group=group)))
    for _, request in sends:
        request.wait()
    return result
