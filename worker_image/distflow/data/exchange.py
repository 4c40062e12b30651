"""Execute a ``RedistributionPlan`` with torch.distributed (gloo on CPU, NCCL on GPU).

Every rank runs ``exchange`` with the same plan, or with its own part of it
(``redistribute.plan_for_rank``: its send row and receive column, built in
O(B + N)). Only metadata is gathered (sample counts, lengths, a schema
digest); each rank then knows the exact byte size of every piece it sends
or receives and moves its data in ONE ``all_to_all_single``:

    rank r: [piece r->0 | piece r->1 | ...]  --all_to_all_single-->  [piece 0->r | piece 1->r | ...]

A piece is one contiguous uint8 buffer in the wire format of
``distflow.data.wire`` (every field of its samples, each chunk 8-byte aligned).
Samples that stay on their rank are never packed or sent; for CPU batches
with a ``NodeBuffer``, pieces between ranks of one node go through shared
memory and only cross-node pieces use the collective. CUDA batches never
touch the node buffer: NCCL carries intra-node pieces device to device
(NVLink or PCIe peer-to-peer), which host shared memory could only slow down
with two pageable copies.

This module holds the few collectives (the metadata all-gathers and the
all_to_all); ``distflow.data.centralized`` is the single-controller baseline,
which returns bit-identical batches through rank 0.

gloo implements ``all_to_all_single`` for CPU tensors (uneven splits, zero
splits), so no list-based fallback is needed. On NCCL the batch must live on
the current CUDA device, and every byte stays there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from distflow.data.batch import PackedBatch, check_same_schema
from distflow.data.buffer import NodeBuffer
from distflow.data.counters import TransferCounters
from distflow.data.redistribute import RankPlan, RedistributionPlan
from distflow.data.wire import (
    WireSizes, assemble, assembly_sources, pack_into, rank_wire_sizes, schema_digest,
)
from distflow.process_group import wire_device

def global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _allgather_ints(values: Sequence[int], group) -> list[list[int]]:
    """All-gather a fixed-length list of int64 from every rank."""
    device = wire_device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.cpu().tolist() for p in parts]


def _allgather_rows(rows: torch.Tensor, header: Sequence[int], capacity: int, group):
    """Every rank's [B_r, k] int64 ``rows`` and its ``header`` ints: ([world] of [B_r, k] CPU, [world] of headers).

    One all-gather of ``[B_r, *header, rows padded to capacity]``; a second, of
    the rows padded to the fullest rank, only when some rank holds more than
    ``capacity`` rows (every rank sees that in the first and joins the second).
    """
    count, width = rows.shape
    start = 1 + len(header)
    device = wire_device(group)
    mine = torch.zeros(start + capacity * width, dtype=torch.int64, device=device)
    mine[:start] = torch.tensor([count, *header], dtype=torch.int64)
    kept = min(count, capacity)
    mine[start: start + kept * width] = rows[:kept].reshape(-1).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    parts = [p.cpu() for p in parts]
    counts, headers = [int(p[0]) for p in parts], [p[1:start].tolist() for p in parts]
    longest = max(counts)
    if longest <= capacity:
        return [p[start: start + n * width].reshape(n, width) for p, n in zip(parts, counts)], headers
    padded = torch.zeros(longest * width, dtype=torch.int64, device=device)
    padded[: count * width] = rows.reshape(-1).to(device)
    full = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(full, padded, group=group)
    return [p.cpu()[: n * width].reshape(n, width) for p, n in zip(full, counts)], headers


def _allgather_lengths(local_lengths: torch.Tensor, digest: int, group):
    rows, headers = _allgather_rows(local_lengths.reshape(-1, 1).to(torch.int64), [digest], 0, group)
    return [r[:, 0] for r in rows], [h[0] for h in headers]


def allgather_lengths(local_lengths: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``seq_lens``: [world] list of [B_r] int64 CPU tensors (B_r may differ).

    Two small all-gathers (counts, then lengths padded to the longest).
    """
    return _allgather_lengths(local_lengths, 0, group)[0]


@dataclass(frozen=True)
class EdgeMetadata:
    """Every rank's per-sample metadata for one edge, from one all-gather (``gather_metadata``)."""

    rows: list[torch.Tensor]
    """[world] of [B_r, 1 + k] int64 CPU tensors: ``seq_lens`` (tokens), then the caller's k columns."""
    digests: list[int]
    """[world] digest of each rank's ``field_schema()``; ``exchange`` checks they agree."""
    plan_digests: list[int]
    """[world] each rank's ``plan_digest`` argument; ``gather_metadata`` checked they agree."""

    @property
    def lengths(self) -> list[torch.Tensor]:
        """[world] of [B_r] int64: every rank's ``seq_lens``."""
        return [rows[:, 0].contiguous() for rows in self.rows]

    @property
    def max_count(self) -> int:
        """Samples on the fullest rank: a ``capacity`` for the next ``gather_metadata``."""
        return max((rows.shape[0] for rows in self.rows), default=0)


def gather_metadata(batch: PackedBatch, columns: Sequence[torch.Tensor] = (), capacity: int = 0,
                    group=None, plan_digest: int = 0) -> EdgeMetadata:
    """All-gather what an edge needs to plan and size its moves, in ONE collective.

    Each rank contributes ``[B_r, schema digest, rows padded to capacity]``
    with one row ``[seq_len, *columns]`` per sample. Lengths, the schema check
    of ``exchange`` and the planner's extra metadata (prompt groups, origin
    ranks) then cost one latency instead of three. When a rank holds more than
    ``capacity`` samples, a second all-gather of the rows padded to the fullest
    rank follows (correct, one latency more); pass the previous edge's
    ``max_count`` to avoid it.

    Collective: every rank calls it with the same number of columns and the
    same ``capacity``.

    ``plan_digest`` rides along in the header: every rank computes each
    redistribution plan on its own (the balancer sums float costs), so the
    caller passes a digest of the plan it executed last (``plan_digest``) and
    all ranks fail together here if any two differ.

    Args:
        batch: this rank's samples.
        columns: k tensors of [B_r] integers (cast to int64), one value per sample.
        capacity: rows every rank pads to in the first all-gather (>= 0).
        group: process group (default: world).
        plan_digest: digest of this rank's previous plan (0: none yet).

    Returns:
        ``EdgeMetadata`` with every rank's rows, in rank order.

    Raises:
        ValueError: a column does not have one value per sample, or capacity < 0.
        RuntimeError: the ranks' ``plan_digest`` differ (on every rank).
    """
    if capacity < 0:
        raise ValueError(f"capacity is {capacity}; give the rows to pad to, >= 0")
    count = batch.num_samples
    for i, column in enumerate(columns):
        if column.shape != (count,):
            raise ValueError(f"columns[{i}] has shape {tuple(column.shape)}; need [{count}] (one per sample)")
    rows = torch.stack([batch.seq_lens.cpu(), *(c.cpu() for c in columns)], 1).to(torch.int64)
    digest = schema_digest(batch.field_schema())
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return EdgeMetadata([rows], [digest], [plan_digest])
    gathered, headers = _allgather_rows(rows, [digest, plan_digest], capacity, group)
    plans = [h[1] for h in headers]
    if len(set(plans)) > 1:
        raise RuntimeError(f"ranks disagree on the last redistribution plan (digest per rank: {plans}); "
                           "each rank computed it from the same gathered metadata, so a rank's balancer "
                           "differs (library versions, float costs): samples were lost or duplicated")
    return EdgeMetadata(gathered, [h[0] for h in headers], plans)


def checked_lengths(batch, src_counts: Sequence[int], group, all_lengths, metadata=None):
    """Lengths of all ranks, after checking schemas agree everywhere and that rank r
    holds ``src_counts[r]`` samples, as the plan says.

    Every check uses gathered data, so all ranks raise together instead of
    one raising and the others hanging in the next collective.
    """
    schema = batch.field_schema()
    digest = schema_digest(schema)
    if metadata is not None:
        if all_lengths is not None:
            raise ValueError("give metadata or all_lengths, not both")
        lengths, digests = metadata.lengths, list(metadata.digests)
        if len(lengths) != len(src_counts):
            raise ValueError(f"metadata covers {len(lengths)} ranks; need one per rank ({len(src_counts)})")
        if not torch.equal(lengths[dist.get_rank(group)], batch.seq_lens.cpu()) or \
                digests[dist.get_rank(group)] != digest:
            raise ValueError("metadata was gathered from another batch than this rank's; "
                             "pass gather_metadata(batch) of the batch being exchanged")
    elif all_lengths is None:
        lengths, digests = _allgather_lengths(batch.seq_lens, digest, group)
    else:
        digests = [d[0] for d in _allgather_ints([digest], group)]
        lengths = [torch.as_tensor(x, dtype=torch.int64).cpu() for x in all_lengths]
        if len(lengths) != len(src_counts):
            raise ValueError(f"all_lengths has {len(lengths)} entries; need one per rank ({len(src_counts)})")
        if not torch.equal(lengths[dist.get_rank(group)], batch.seq_lens):
            raise ValueError("all_lengths[rank] differs from this rank's batch.seq_lens; "
                             "pass the output of allgather_lengths(batch.seq_lens)")
    if len(set(digests)) > 1:
        _raise_schema_mismatch(schema, len(digests), group)
    for r, (count, lens) in enumerate(zip(src_counts, lengths)):
        if count != lens.numel():
            raise ValueError(f"rank {r} has {lens.numel()} samples but plan.src_holdings[{r}] "
                             f"lists {count}; build the plan from the actual layout")
    return schema, [x.tolist() for x in lengths]


def _raise_schema_mismatch(schema, num_ranks: int, group) -> None:
    """Digests differ: gather the full schemas (rare path) to name the field."""
    schemas: list = [None] * num_ranks
    dist.all_gather_object(schemas, tuple(schema), group=group)
    for r, other in enumerate(schemas):
        check_same_schema(schemas[0], other, f"rank {r} (compared with rank 0)")


def check_inputs(batch, plan, group, node_of_rank, node_buffer) -> None:
    world = dist.get_world_size(group)
    if plan.num_ranks != world:
        raise ValueError(f"plan covers {plan.num_ranks} ranks but the group has {world}; "
                         "plan over every rank of the group (empty lists for idle ranks)")
    if (node_of_rank is None) != (node_buffer is None):
        raise ValueError("give node_of_rank and node_buffer together (or neither)")
    if node_of_rank is not None and len(node_of_rank) != world:
        raise ValueError(f"node_of_rank has {len(node_of_rank)} entries; need one per rank ({world})")
    device = wire_device(group)
    if batch.field_schema() and batch.device.type != device.type:
        raise ValueError(f"batch is on {batch.device} but the data plane moves {device.type} tensors "
                         "over this group; move the batch with .to()")


def _all_to_all_pieces(batch, plan: RankPlan, schema, sizes: WireSizes, group, device
                       ) -> dict[int, torch.Tensor]:
    """One all_to_all_single over the pieces not handed over in shared memory; src -> bytes.

    Skipped on every rank when no rank sends anything (``sizes.any_on_wire``).
    """
    if not sizes.any_on_wire:
        return {}
    send_splits = [0 if shm else n for n, shm in zip(sizes.send, sizes.send_via_shm)]
    recv_splits = [0 if shm else n for n, shm in zip(sizes.recv, sizes.recv_via_shm)]
    send = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
    offset = 0
    for dst, nbytes in enumerate(send_splits):
        if nbytes:
            pack_into(send[offset: offset + nbytes], batch, plan.sends[dst], schema)
        offset += nbytes
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    pieces, offset = {}, 0
    for src, nbytes in enumerate(recv_splits):
        if nbytes:
            pieces[src] = recv[offset: offset + nbytes]
        offset += nbytes
    return pieces


def exchange(
    batch: PackedBatch,
    plan: RedistributionPlan | RankPlan,
    group=None,
    counters: TransferCounters | None = None,
    edge: str = "",
    *,
    all_lengths: Sequence[torch.Tensor] | None = None,
    metadata: EdgeMetadata | None = None,
    node_of_rank: Sequence[int] | None = None,
    node_buffer: NodeBuffer | None = None,
    step: int = 0,
) -> PackedBatch:
    """Move samples as ``plan`` says; returns this rank's ``plan.dst_assignment[rank]`` in order.

    Collective: every rank of ``group`` calls it with the same plan, or with
    its own ``plan_for_rank`` part of it (O(B + N) to build and to size, where
    the whole plan is O(B + N^2)); both move the same bytes. An identity plan
    returns ``batch`` itself and moves nothing (local cache).
    Otherwise: all-gather counts and a schema digest (and the lengths, unless
    ``all_lengths`` is given; nothing when ``metadata`` is), publish same-node pieces to ``node_buffer``,
    one ``all_to_all_single`` for the rest, take same-node pieces, and
    assemble the planned order with one copy per field.

    Node-buffer files are named by (step, edge, src, dst); exchanging the
    same edge twice in a step is safe because the metadata all-gather of the
    second call waits for every rank to finish the first.

    Args:
        batch: this rank's samples, in ``plan.src_holdings[rank]`` order.
        plan: the same ``RedistributionPlan`` on every rank (group ranks), or
            this rank's ``RankPlan`` (``plan_for_rank(..., rank)``).
        group: process group (default: world).
        counters: records wire bytes (fields padded to 8 bytes) per edge.
        edge: name of the DAG edge, e.g. ``"rollout->actor"``.
        node_of_rank: node index of each group rank; with ``node_buffer``,
            pieces between ranks of one node go through shared memory (CPU
            batches only: on CUDA, NCCL carries them device to device).
        all_lengths: [world] of [B_r] int64, from ``allgather_lengths``, when
            the caller already gathered them (e.g. to balance); the schema
            digests then still cost one all-gather.
        metadata: ``gather_metadata(batch)`` when the caller gathered it to
            plan: lengths and schema digests at once, so the exchange runs
            no metadata collective at all.
        step: training step, keys node-buffer files.

    Returns:
        A ``PackedBatch`` whose fields may be views into the receive buffer.

    Raises:
        ValueError: plan and group sizes differ, a ``RankPlan`` for another
            rank, a rank's batch does not match the plan, schemas differ
            between ranks (names the field), or the batch is on the wrong
            device for the backend.
    """
    check_inputs(batch, plan, group, node_of_rank, node_buffer)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(plan, RankPlan) and plan.rank != rank:
        raise ValueError(f"plan is rank {plan.rank}'s part but this is rank {rank} of the group; "
                         "build it with plan_for_rank(..., rank=dist.get_rank(group))")
    if plan.is_identity:
        if counters is not None:
            counters.record_exchange(edge, cache_hit=True)
        return batch
    if isinstance(plan, RedistributionPlan):
        plan = plan.for_rank(rank)
    schema, lengths = checked_lengths(batch, plan.src_counts, group, all_lengths, metadata)
    device = wire_device(group)
    sizes = rank_wire_sizes(plan, schema, lengths, node_of_rank, device)
    for dst in range(world):
        if sizes.send_via_shm[dst] and sizes.send[dst]:
            out = node_buffer.reserve(step, edge, rank, dst, sizes.send[dst])
            pack_into(out, batch, plan.sends[dst], schema)
            node_buffer.commit(step, edge, rank, dst)
    received = _all_to_all_pieces(batch, plan, schema, sizes, group, device)
    for src in range(world):
        if sizes.recv_via_shm[src] and sizes.recv[src]:
            received[src] = node_buffer.take(step, edge, src, rank)
    sources = assembly_sources(batch, plan, received, schema, lengths, device)
    result = assemble(plan.recv_segments(), sources, schema, device)
    if counters is not None:
        _count(counters, edge, rank, sizes)
    return result


def _count(counters: TransferCounters, edge: str, rank: int, sizes: WireSizes) -> None:
    for peer in range(len(sizes.send)):
        if peer != rank:
            counters.record_send(edge, rank, peer, sizes.send[peer], handed_over=sizes.send_via_shm[peer])
            counters.record_receive(edge, sizes.recv[peer])
    counters.record_exchange(edge, cache_hit=not sizes.any_moved)


