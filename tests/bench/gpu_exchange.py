"""The funnel edge on the step data's device, checked for content and timed (part of gpu_check).

One rank per GPU over NCCL (gloo and CPU in the dry run). Each rank builds its
funnel batch (tests/bench/funnel.py, values encode (rank, position)) on the
device, plans the balanced edge, and runs ``exchange`` with a node buffer and
every rank on one node, as the local launcher does. Then:

- content: every rank rebuilds every source batch on the host and checks each
  sample it received, field by field, bit for bit;
- route: on CUDA no byte may go through the node buffer (NCCL carries the
  intra-node pieces); on CPU the node buffer carries them;
- time: the edge (``exchange``, metadata all-gather included) against the bare
  ``all_to_all_single`` of the same piece sizes, and the centralized edge; the
  slowest rank's time, median of ``repeats``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from tests.bench._common import median
from tests.bench.funnel import _byte_matrices, _plan_edge, make_batch, sample_lengths

EDGE_TARGET = 1.25
"""The edge may take at most this many times the bare collective of its bytes."""


def _on(batch, device: torch.device):
    return type(batch)(batch.seq_lens, {k: v.to(device) for k, v in batch.token_fields.items()},
                       {k: v.to(device) for k, v in batch.sample_fields.items()})


def _mismatches(received, plan, rank: int, per_rank: int, nominal: int) -> int:
    """Samples of ``received`` that differ from the planned source sample (any field, any bit)."""
    sources = [make_batch(sample_lengths(src, per_rank, nominal), src) for src in range(plan.num_ranks)]
    where = {gid: (src, pos) for src, held in enumerate(plan.src_holdings) for pos, gid in enumerate(held)}
    got = _on(received, torch.device("cpu"))
    got_offsets = got.token_offsets
    bad = 0
    for i, gid in enumerate(plan.dst_assignment[rank]):
        src, pos = where[gid]
        want, offsets = sources[src], sources[src].token_offsets
        same = all(torch.equal(got.token_fields[k][got_offsets[i]:got_offsets[i + 1]],
                               v[offsets[pos]:offsets[pos + 1]]) for k, v in want.token_fields.items())
        same = same and all(torch.equal(got.sample_fields[k][i], v[pos]) for k, v in want.sample_fields.items())
        bad += not same
    return bad


def _slowest(fn, device: torch.device, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for ``fn`` (after one warm-up)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return median(times[1:])


def _measure(rank: int, world: int, device: torch.device, nominal: int, per_rank: int, repeats: int,
             node_buffer) -> dict:
    import torch.distributed as dist

    from distflow.data.counters import TransferCounters
    from distflow.data.centralized import exchange_centralized
    from distflow.data.exchange import exchange

    batch = _on(make_batch(sample_lengths(rank, per_rank, nominal), rank), device)
    metadata, plan = _plan_edge(batch)
    counters = TransferCounters()
    received = exchange(batch, plan.for_rank(rank), counters=counters, edge="check", metadata=metadata,
                        node_of_rank=[0] * world, node_buffer=node_buffer, step=0)
    bad = torch.tensor([_mismatches(received, plan, rank, per_rank, nominal)], device=device)
    dist.all_reduce(bad)
    wire, inbound, _ = _byte_matrices(batch, plan, metadata.lengths)
    send_splits, recv_splits = wire[rank], [row[rank] for row in wire]
    send = torch.zeros(sum(send_splits), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    edges = iter(range(1, 1 << 30))
    variants = {
        "distflow": lambda: exchange(batch, plan.for_rank(rank), metadata=metadata, node_of_rank=[0] * world,
                                     node_buffer=node_buffer, step=next(edges)),
        "bare_all_to_all": lambda: dist.all_to_all_single(recv, send, recv_splits, send_splits),
        "centralized": lambda: exchange_centralized(batch, plan, metadata=metadata),
    }
    seconds = {name: _slowest(fn, device, repeats) for name, fn in variants.items()}
    handed = torch.tensor([sum(counters.bytes_handed_over.values())], dtype=torch.float64, device=device)
    dist.all_reduce(handed)
    return {"nominal_tokens": nominal, "samples_per_rank": per_rank, "total_bytes": sum(inbound),
            "mismatched_samples": int(bad), "node_buffer_bytes": int(handed), "seconds": seconds,
            "edge_over_bare": seconds["distflow"] / seconds["bare_all_to_all"],
            "centralized_over_edge": seconds["centralized"] / seconds["distflow"]}


def _worker(rank: int, world: int, port: int, device_type: str, quick: bool, out_dir: str) -> None:
    import torch.distributed as dist

    from distflow.data.buffer import NodeBuffer

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    node_buffer = NodeBuffer(f"gpu-check-{port}", 0, root=out_dir)
    nominals, per_rank, repeats = ((256,), 4, 2) if quick else ((4096, 16384), 32, 7)
    rows = [_measure(rank, world, device, nominal, per_rank, repeats, node_buffer) for nominal in nominals]
    if rank == 0:
        Path(out_dir, "exchange.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def exchange_check(device: torch.device, quick: bool) -> dict:
    """Rows per nominal sample length (see the module docstring); skipped with one GPU."""
    import torch.multiprocessing as mp

    from tests.dist._spawn import free_port

    world = min(8, torch.cuda.device_count()) if device.type == "cuda" else 2
    if world < 2:
        return {"skipped": f"{world} GPU visible; NCCL needs one GPU per rank, so at least 2"}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, free_port(), device.type, quick, tmp), nprocs=world, join=True)
        rows = json.loads(Path(tmp, "exchange.json").read_text())
    return {"world_size": world, "rows": rows, "target_edge_over_bare": EDGE_TARGET,
            "meets_target": all(r["edge_over_bare"] <= EDGE_TARGET for r in rows),
            "content_ok": all(r["mismatched_samples"] == 0 for r in rows)}


def exchange_table(part: dict) -> str:
    if "rows" not in part:
        return f"`{part.get('skipped') or part.get('error')}`"
    lines = [f"{part['world_size']} ranks; target: edge <= {EDGE_TARGET}x the bare all_to_all of its bytes", "",
             "| tokens/sample | MiB | mismatched samples | node-buffer bytes | edge ms | bare ms | centralized ms "
             "| edge / bare | centralized / edge |", "|---|---|---|---|---|---|---|---|---|"]
    for r in part["rows"]:
        s = r["seconds"]
        lines.append(f"| {r['nominal_tokens']} | {r['total_bytes'] / 2**20:.1f} | {r['mismatched_samples']} "
                     f"| {r['node_buffer_bytes']} | {s['distflow'] * 1e3:.2f} | {s['bare_all_to_all'] * 1e3:.2f} "
                     f"| {s['centralized'] * 1e3:.2f} | {r['edge_over_bare']:.2f} | {r['centralized_over_edge']:.2f} |")
    return "\n".join(lines)
