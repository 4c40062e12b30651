"""The wire format of the data plane: pure packing, no torch.distributed.

A piece is one contiguous uint8 buffer holding, for its samples, every field
in ``field_schema()`` order (token fields, then sample fields), each chunk
padded to ``ALIGN`` bytes so the receiver can view it as float/int without
copying. This module sizes pieces (``piece_nbytes``, ``rank_wire_sizes``),
packs and unpacks them, and assembles a destination's batch in planned order;
``distflow.data.exchange`` and ``distflow.data.centralized`` move the bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from distflow.data.batch import SAMPLE, TOKEN, FieldSpec, PackedBatch
from distflow.data.redistribute import RankPlan, RedistributionPlan


ALIGN = 8
"""Bytes each field chunk is padded to, so uint8 -> dtype views are aligned."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def piece_nbytes(schema: Sequence[FieldSpec], num_tokens: int, num_samples: int) -> int:
    """Wire size in bytes of a piece with ``num_tokens`` tokens over ``num_samples`` samples."""
    return sum(
        aligned((num_tokens if s.kind == TOKEN else num_samples) * s.row_nbytes) for s in schema
    )


def schema_digest(schema: Sequence[FieldSpec]) -> int:
    return int.from_bytes(hashlib.sha256(repr(tuple(schema)).encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class WireSizes:
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


def rank_wire_sizes(plan: RankPlan, schema, lengths, node_of_rank, device: torch.device) -> WireSizes:
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
    return WireSizes(
        send=[0 if dst == rank else nbytes(rank, pos) for dst, pos in enumerate(plan.sends)],
        recv=[0 if src == rank else nbytes(src, pos) for src, pos in enumerate(plan.receives)],
        send_via_shm=[via_shm(rank, dst) for dst in peers],
        recv_via_shm=[via_shm(src, rank) for src in peers],
        any_on_wire=any_on_wire,
        any_moved=any_moved,
    )


def pack_into(out: torch.Tensor, batch: PackedBatch, positions: Sequence[int], schema) -> None:
    """Write the samples at ``positions`` of ``batch`` into the uint8 buffer ``out`` (one copy,
    on their common device)."""
    runs = batch.row_ranges(positions)
    rows = {TOKEN: sum(t1 - t0 for _, _, t0, t1 in runs), SAMPLE: sum(b - a for a, b, _, _ in runs)}
    offset = 0
    for spec in schema:
        nbytes = rows[spec.kind] * spec.row_nbytes
        target = out[offset: offset + nbytes].view(spec.dtype).view(rows[spec.kind], *spec.trailing_shape)
        batch.gather_field(spec.name, runs, out=target)
        offset += aligned(nbytes)


def pack(batch, positions, schema, nbytes, device) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pack_into(out, batch, positions, schema)
    return out


def unpack(buffer: torch.Tensor, schema, seq_lens: Sequence[int]) -> PackedBatch:
    """Views into ``buffer`` (no copy): the inverse of ``pack_into``."""
    num_tokens, num_samples = sum(seq_lens), len(seq_lens)
    fields = {TOKEN: {}, SAMPLE: {}}
    offset = 0
    for spec in schema:
        rows = num_tokens if spec.kind == TOKEN else num_samples
        nbytes = rows * spec.row_nbytes
        chunk = buffer[offset: offset + nbytes]
        fields[spec.kind][spec.name] = chunk.view(spec.dtype).view(rows, *spec.trailing_shape)
        offset += aligned(nbytes)
    return PackedBatch(torch.tensor(list(seq_lens), dtype=torch.int64), fields[TOKEN], fields[SAMPLE])


def empty_batch(schema, device) -> PackedBatch:
    fields = {TOKEN: {}, SAMPLE: {}}
    for spec in schema:
        fields[spec.kind][spec.name] = torch.empty((0, *spec.trailing_shape), dtype=spec.dtype, device=device)
    return PackedBatch(torch.zeros(0, dtype=torch.int64), fields[TOKEN], fields[SAMPLE])


def assemble(segments, sources: dict, schema, device) -> PackedBatch:
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
        return empty_batch(schema, device)
    first, first_runs = pieces[0]
    if len(pieces) == 1 and first_runs == [(0, first.num_samples, 0, first.num_tokens)]:
        return first
    fields = {TOKEN: {}, SAMPLE: {}}
    for spec in schema:
        parts = [part for batch, runs in pieces for part in batch.field_rows(spec.name, runs)]
        fields[spec.kind][spec.name] = torch.cat(parts)
    seq_lens = torch.cat([batch.seq_lens[a:b] for batch, runs in pieces for a, b, _, _ in runs])
    return PackedBatch(seq_lens, fields[TOKEN], fields[SAMPLE])


def assembly_sources(batch, plan: RankPlan, received, schema, lengths, device) -> dict:
    """``assemble``'s sources: the local batch at the kept positions, plus each received piece."""
    rank = plan.rank
    sources = {rank: (batch, plan.sends[rank])}
    for src, positions in enumerate(plan.receives):
        if src != rank and positions:
            # a piece with samples but zero bytes (no fields, or only empty samples
            # and no sample fields) was never sent: unpack it from nothing
            buffer = received.get(src, torch.empty(0, dtype=torch.uint8, device=device))
            piece_lens = [lengths[src][p] for p in positions]
            sources[src] = (unpack(buffer, schema, piece_lens), None)
    return sources


def planned_lengths(plan: RedistributionPlan, lengths, dst: int) -> list[int]:
    length_of = {gid: lengths[src][p] for src, held in enumerate(plan.src_holdings)
                 for p, gid in enumerate(held)}
    return [length_of[gid] for gid in plan.dst_assignment[dst]]
