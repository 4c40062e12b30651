"""Execute a ``RedistributionPlan`` with torch.distributed (gloo on CPU, NCCL on GPU).

Every rank runs ``exchange`` with the same plan, or with its own part of it
(``redistribute.plan_for_rank``: its send row and receive column, built in
O(B + N)). Only metadata is gathered (sample counts, lengths, a schema
digest); each rank then knows the exact byte size of every piece it sends
or receives and moves its data in ONE ``all_to_all_single``:

    rank r: [piece r->0 | piece r->1 | ...]  --all_to_all_single-->  [piece 0->r | piece 1->r | ...]

A piece is one contiguous uint8 buffer holding, for its samples, every field
in ``field_schema()`` order (token fields, then sample fields), each chunk
padded to 8 bytes so the receiver can view it as float/int without copying.
Samples that stay on their rank are never packed or sent; for CPU batches
with a ``NodeBuffer``, pieces between ranks of one node go through shared
memory and only cross-node pieces use the collective. CUDA batches never
touch the node buffer: NCCL carries intra-node pieces device to device
(NVLink or PCIe peer-to-peer), which host shared memory could only slow down
with two pageable copies.

``exchange_centralized`` is the single-controller baseline (DistFlow's
comparison, arXiv 2507.13833): every rank's whole batch goes to rank 0,
which reorders and sends each rank its part. Both return bit-identical batches.

gloo implements ``all_to_all_single`` for CPU tensors (uneven splits, zero
splits), so no list-based fallback is needed. On NCCL the batch must live on
the current CUDA device, and every byte stays there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from distflow.data.batch import SAMPLE, TOKEN, FieldSpec, PackedBatch, check_same_schema
from distflow.data.buffer import NodeBuffer
from distflow.data.counters import TransferCounters
from distflow.data.redistribute import RankPlan, RedistributionPlan
from distflow.process_group import wire_device

ALIGN = 8
"""Bytes each field chunk is padded to, so uint8 -> dtype views are aligned."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def piece_nbytes(schema: Sequence[FieldSpec], num_tokens: int, num_samples: int) -> int:
    """Wire size in bytes of a piece with ``num_tokens`` tokens over ``num_samples`` samples."""
    return sum(
        _aligned((num_tokens if s.kind == TOKEN else num_samples) * s.row_nbytes) for s in schema
    )


def _global_rank(group, rank: int) -> int:
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


def _schema_digest(schema: Sequence[FieldSpec]) -> int:
    return int.from_bytes(hashlib.sha256(repr(tuple(schema)).encode()).digest()[:8], "little") >> 1


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
    digest = _schema_digest(batch.field_schema())
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return EdgeMetadata([rows], [digest], [plan_digest])
    gathered, headers = _allgather_rows(rows, [digest, plan_digest], capacity, group)
    plans = [h[1] for h in headers]
    if len(set(plans)) > 1:
        raise RuntimeError(f"ranks disagree on the last redistribution plan (digest per rank: {plans}); "
                           "each rank computed it from the same gathered metadata, so a rank's balancer "
                           "differs (library versions, float costs): samples were lost or duplicated")
    return EdgeMetadata(gathered, [h[0] for h in headers], plans)


def _gather_metadata(batch, src_counts: Sequence[int], group, all_lengths, metadata=None):
    """Lengths of all ranks, after checking schemas agree everywhere and that rank r
    holds ``src_counts[r]`` samples, as the plan says.

    Every check uses gathered data, so all ranks raise together instead of
    one raising and the others hanging in the next collective.
    """
    schema = batch.field_schema()
    digest = _schema_digest(schema)
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


@dataclass(frozen=True)
class _WireSizes:
    """One rank's piece sizes in bytes (as on the wire) and what every rank must agree on."""

    send: list[int]
    """[N] bytes of this rank's piece to each rank (0 for itself: what stays is never sent)."""
    recv: list[int]
    """[N] bytes of each rank's piece to this one (0 for itself)."""
    send_via_shm: list[bool]
    """[N] the piece to that rank goes through the node buffer."""
    recv_via_shm: list[bool]
    """[N] the piece from that rank comes through the node buffer."""
    any_on_wire: bool
    """Some rank sends bytes through the collective: all ranks run it, or none."""
    any_moved: bool
    """Some piece between two ranks has bytes; if none, the exchange is a cache hit."""


def _rank_wire_sizes(plan: RankPlan, schema, lengths, node_of_rank, device: torch.device) -> _WireSizes:
    """This rank's send row and receive column of the [N][N] piece-size matrix, in O(B + N).

    Same-node pieces go through the node buffer only for CPU batches
    (``device``), when ``node_of_rank`` is given.

    The group-wide flags come from ``plan.destinations`` without sizing other
    ranks' pieces: a piece has bytes exactly when one of its samples alone
    would (a sample field, or a token field and a non-empty sample).
    """
    rank = plan.rank

    def nbytes(src: int, positions: Sequence[int]) -> int:
        lens = lengths[src]
        return piece_nbytes(schema, sum(lens[p] for p in positions), len(positions)) if positions else 0

    shm = node_of_rank is not None and device.type == "cpu"

    def via_shm(src: int, dst: int) -> bool:
        return shm and src != dst and node_of_rank[src] == node_of_rank[dst]

    sample_has_bytes = piece_nbytes(schema, 0, 1) > 0
    token_has_bytes = piece_nbytes(schema, 1, 0) > 0
    moved = ((src, dst) for src, dsts in enumerate(plan.destinations) for pos, dst in enumerate(dsts)
             if dst != src and (sample_has_bytes or (token_has_bytes and lengths[src][pos] > 0)))
    any_moved = any_on_wire = False
    for src, dst in moved:
        any_moved = True
        if not via_shm(src, dst):
            any_on_wire = True
            break
    peers = range(plan.num_ranks)
    return _WireSizes(
        send=[0 if dst == rank else nbytes(rank, pos) for dst, pos in enumerate(plan.sends)],
        recv=[0 if src == rank else nbytes(src, pos) for src, pos in enumerate(plan.receives)],
        send_via_shm=[via_shm(rank, dst) for dst in peers],
        recv_via_shm=[via_shm(src, rank) for src in peers],
        any_on_wire=any_on_wire,
        any_moved=any_moved,
    )


def _pack_into(out: torch.Tensor, batch: PackedBatch, positions: Sequence[int], schema) -> None:
    """Write the samples at ``positions`` of ``batch`` into the uint8 buffer ``out`` (one copy,
    on their common device)."""
    runs = batch.row_ranges(positions)
    rows = {TOKEN: sum(t1 - t0 for _, _, t0, t1 in runs), SAMPLE: sum(b - a for a, b, _, _ in runs)}
    offset = 0
    for spec in schema:
        nbytes = rows[spec.kind] * spec.row_nbytes
        target = out[offset: offset + nbytes].view(spec.dtype).view(rows[spec.kind], *spec.trailing_shape)
        batch.gather_field(spec.name, runs, out=target)
        offset += _aligned(nbytes)


def _pack(batch, positions, schema, nbytes, device) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _pack_into(out, batch, positions, schema)
    return out


def _unpack(buffer: torch.Tensor, schema, seq_lens: Sequence[int]) -> PackedBatch:
    """Views into ``buffer`` (no copy): the inverse of ``_pack_into``."""
    num_tokens, num_samples = sum(seq_lens), len(seq_lens)
    fields = {TOKEN: {}, SAMPLE: {}}
    offset = 0
    for spec in schema:
        rows = num_tokens if spec.kind == TOKEN else num_samples
        nbytes = rows * spec.row_nbytes
        chunk = buffer[offset: offset + nbytes]
        fields[spec.kind][spec.name] = chunk.view(spec.dtype).view(rows, *spec.trailing_shape)
        offset += _aligned(nbytes)
    return PackedBatch(torch.tensor(list(seq_lens), dtype=torch.int64), fields[TOKEN], fields[SAMPLE])


def _empty_batch(schema, device) -> PackedBatch:
    fields = {TOKEN: {}, SAMPLE: {}}
    for spec in schema:
        fields[spec.kind][spec.name] = torch.empty((0, *spec.trailing_shape), dtype=spec.dtype, device=device)
    return PackedBatch(torch.zeros(0, dtype=torch.int64), fields[TOKEN], fields[SAMPLE])


def _assemble(segments, sources: dict, schema, device) -> PackedBatch:
    """A batch in planned order: one copy per field, none if a single whole batch suffices.

    ``segments`` are the destination's ``recv_segments``; ``sources[src]`` is
    ``(batch, positions)``: the piece from src is ``batch`` at ``positions``,
    or the whole of ``batch`` when positions is None.
    """
    pieces = []
    for src, start, stop in segments:
        batch, positions = sources[src]
        wanted = range(start, stop) if positions is None else positions[start:stop]
        pieces.append((batch, batch.row_ranges(wanted)))
    if not pieces:
        return _empty_batch(schema, device)
    first, first_runs = pieces[0]
    if len(pieces) == 1 and first_runs == [(0, first.num_samples, 0, first.num_tokens)]:
        return first
    fields = {TOKEN: {}, SAMPLE: {}}
    for spec in schema:
        parts = [part for batch, runs in pieces for part in batch.field_rows(spec.name, runs)]
        fields[spec.kind][spec.name] = torch.cat(parts)
    seq_lens = torch.cat([batch.seq_lens[a:b] for batch, runs in pieces for a, b, _, _ in runs])
    return PackedBatch(seq_lens, fields[TOKEN], fields[SAMPLE])


def _check_inputs(batch, plan, group, node_of_rank, node_buffer) -> None:
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


def _all_to_all_pieces(batch, plan: RankPlan, schema, sizes: _WireSizes, group, device
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
            _pack_into(send[offset: offset + nbytes], batch, plan.sends[dst], schema)
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
    _check_inputs(batch, plan, group, node_of_rank, node_buffer)
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
    schema, lengths = _gather_metadata(batch, plan.src_counts, group, all_lengths, metadata)
    device = wire_device(group)
    sizes = _rank_wire_sizes(plan, schema, lengths, node_of_rank, device)
    for dst in range(world):
        if sizes.send_via_shm[dst] and sizes.send[dst]:
            out = node_buffer.reserve(step, edge, rank, dst, sizes.send[dst])
            _pack_into(out, batch, plan.sends[dst], schema)
            node_buffer.commit(step, edge, rank, dst)
    received = _all_to_all_pieces(batch, plan, schema, sizes, group, device)
    for src in range(world):
        if sizes.recv_via_shm[src] and sizes.recv[src]:
            received[src] = node_buffer.take(step, edge, src, rank)
    result = _assemble(plan.recv_segments(), _sources(batch, plan, received, schema, lengths, device),
                       schema, device)
    if counters is not None:
        _count(counters, edge, rank, sizes)
    return result


def _sources(batch, plan: RankPlan, received, schema, lengths, device) -> dict:
    """``_assemble``'s sources: the local batch at the kept positions, plus each received piece."""
    rank = plan.rank
    sources = {rank: (batch, plan.sends[rank])}
    for src, positions in enumerate(plan.receives):
        if src != rank and positions:
            # a piece with samples but zero bytes (no fields, or only empty samples
            # and no sample fields) was never sent: unpack it from nothing
            buffer = received.get(src, torch.empty(0, dtype=torch.uint8, device=device))
            piece_lens = [lengths[src][p] for p in positions]
            sources[src] = (_unpack(buffer, schema, piece_lens), None)
    return sources


def _count(counters: TransferCounters, edge: str, rank: int, sizes: _WireSizes) -> None:
    for peer in range(len(sizes.send)):
        if peer != rank:
            counters.record_send(edge, rank, peer, sizes.send[peer], handed_over=sizes.send_via_shm[peer])
            counters.record_receive(edge, sizes.recv[peer])
    counters.record_exchange(edge, cache_hit=not sizes.any_moved)


def _planned_lengths(plan: RedistributionPlan, lengths, dst: int) -> list[int]:
    length_of = {gid: lengths[src][p] for src, held in enumerate(plan.src_holdings)
                 for p, gid in enumerate(held)}
    return [length_of[gid] for gid in plan.dst_assignment[dst]]


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
    _check_inputs(batch, plan, group, None, None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    schema, lengths = _gather_metadata(batch, [len(h) for h in plan.src_holdings], group, all_lengths,
                                       metadata)
    device = wire_device(group)
    planned = [_planned_lengths(plan, lengths, dst) for dst in range(world)]
    inbound = [piece_nbytes(schema, sum(lens), len(lens)) for lens in lengths]
    outbound = [piece_nbytes(schema, sum(lens), len(lens)) for lens in planned]
    root_global = _global_rank(group, root)
    if rank == root:
        result = _centralized_root(batch, plan, schema, lengths, inbound, outbound, group, device, root)
    else:
        if inbound[rank]:
            whole = _pack(batch, range(batch.num_samples), schema, inbound[rank], device)
            dist.send(whole, dst=root_global, group=group)
        buffer = torch.empty(outbound[rank], dtype=torch.uint8, device=device)
        if outbound[rank]:
            dist.recv(buffer, src=root_global, group=group)
        result = _unpack(buffer, schema, planned[rank])
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
            requests.append(dist.irecv(buffers[src], src=_global_rank(group, src), group=group))
    for request in requests:
        request.wait()
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    full = {src: batch if src == root else _unpack(buffers.get(src, empty), schema, lengths[src])
            for src in range(world)}
    result, sends = None, []
    for dst in range(world):
        sources = {src: (full[src], plan.sends[src][dst]) for src in range(world)}
        part = _assemble(plan.recv_segments(dst), sources, schema, device)
        if dst == root:
            result = part
        elif outbound[dst]:
            out = _pack(part, range(part.num_samples), schema, outbound[dst], device)
            sends.append((out, dist.isend(out, dst=_global_rank(group, dst), group=group)))
    for _, request in sends:
        request.wait()
    return result
