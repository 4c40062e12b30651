"""The funnel: the distributed data plane against routing every edge through rank 0.

One edge of a GRPO step (the advantage -> actor edge, the one the planner
marks *redistribute*) on N gloo ranks: each rank holds the samples it
generated (rollout layout) and the samples must end in the token-balanced
train layout. Four ways to do it, alternated in one run:

- ``distflow``: what the data coordinator does: all-gather the metadata
  (lengths and schema digests, one ``all_gather``), balance (``balanced_assignment``), build this rank's part of the plan
  (``plan_for_rank``), ``exchange`` (one packed ``all_to_all_single``).
- ``centralized``: the same balancing and the whole plan (the root rebuilds
  every rank's batch), then ``exchange_centralized`` (every batch to rank 0,
  rank 0 rebuilds and sends each rank its part).
- ``bare_all_to_all``: the floor for ``distflow``: one ``all_to_all_single``
  of raw bytes with exactly the same byte matrix, no packing or planning.
- ``bare_gather_scatter``: the floor for ``centralized``: raw bytes to rank
  0 and back, same sizes, no packing.

Samples carry what a GRPO actor update reads: ``input_ids`` int64,
``response_mask`` int8, ``old_log_probs``/``ref_log_probs``/``advantages``
float32 per token (21 bytes/token), and ``prompt_len``, ``response_len``,
``group_index`` int64 and ``scores`` float32 per sample. Lengths are drawn
uniformly in [L/2, 3L/2] around the nominal L, seeded.

Bytes are the product's own counters (sent + received per rank, padding
included); the busiest rank is the maximum over ranks. Times are the slowest
rank's wall time between two barriers.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tests.bench._common import max_over_ranks, median, reset_peak_rss, rotated, peak_rss_bytes

VARIANTS = ("distflow", "centralized", "distflow_exchange", "centralized_exchange",
            "bare_all_to_all", "bare_gather_scatter")
TOKEN_FIELDS = {"input_ids": torch.int64, "response_mask": torch.int8, "old_log_probs": torch.float32,
                "ref_log_probs": torch.float32, "advantages": torch.float32}
SAMPLE_FIELDS = {"prompt_len": torch.int64, "response_len": torch.int64, "group_index": torch.int64,
                 "scores": torch.float32}
BYTES_PER_TOKEN = sum(torch.empty(0, dtype=d).element_size() for d in TOKEN_FIELDS.values())


def sample_lengths(rank: int, num_samples: int, nominal: int, seed: int = 0) -> list[int]:
    """[num_samples] lengths of one rank's samples, uniform in [nominal/2, 3*nominal/2]."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + nominal)
    low = max(1, nominal // 2)
    return torch.randint(low, low + nominal + 1, (num_samples,), generator=gen).tolist()


def make_batch(lengths: list[int], rank: int):
    """A PackedBatch with the GRPO actor fields; values encode (rank, position) to check delivery."""
    from distflow.data.batch import PackedBatch

    total = sum(lengths)
    base = torch.arange(total, dtype=torch.int64) + rank * 10_000_000
    tokens = {name: base.to(dtype) for name, dtype in TOKEN_FIELDS.items()}
    count = len(lengths)
    ids = torch.arange(count, dtype=torch.int64) + rank * 1000
    samples = {name: ids.to(dtype) for name, dtype in SAMPLE_FIELDS.items()}
    return PackedBatch(torch.tensor(lengths, dtype=torch.int64), tokens, samples)


def _plan_edge(batch, rank_plan: bool = False):
    """What the coordinator does before moving: gather the metadata (one all-gather, its
    capacity learned from earlier edges: every rank holds ``batch.num_samples`` here), balance,
    plan: this rank's part with ``rank_plan`` (the distributed coordinator), else the whole
    plan (centralized). Returns (metadata, plan)."""
    import torch.distributed as dist

    from distflow.data.balance import sample_cost
    from distflow.data.exchange import gather_metadata
    from distflow.data.redistribute import balanced_assignment, plan_for_rank, plan_redistribution

    metadata = gather_metadata(batch, capacity=batch.num_samples)
    lengths = metadata.lengths
    holdings, offset = [], 0
    for lens in lengths:
        holdings.append(list(range(offset, offset + lens.numel())))
        offset += lens.numel()
    flat = torch.cat(lengths).tolist()
    target = balanced_assignment(holdings, [sample_cost(n) for n in flat])
    if rank_plan:
        return metadata, plan_for_rank(holdings, target, dist.get_rank())
    return metadata, plan_redistribution(holdings, target)


def _byte_matrices(batch, plan, lengths):
    """(wire[src][dst] of the distributed exchange, inbound[r], outbound[r] of the centralized one)."""
    from distflow.data.wire import piece_nbytes

    schema = batch.field_schema()
    lens = [x.tolist() for x in lengths]
    wire = [[piece_nbytes(schema, sum(lens[s][p] for p in pos), len(pos)) if pos and s != d else 0
             for d, pos in enumerate(row)] for s, row in enumerate(plan.sends)]
    length_of = {gid: lens[s][p] for s, held in enumerate(plan.src_holdings) for p, gid in enumerate(held)}
    inbound = [piece_nbytes(schema, sum(x), len(x)) for x in lens]
    outbound = [piece_nbytes(schema, sum(length_of[g] for g in ids), len(ids)) for ids in plan.dst_assignment]
    return wire, inbound, outbound


def _bare_all_to_all(wire, rank: int, send: torch.Tensor) -> None:
    import torch.distributed as dist

    send_splits = wire[rank]
    recv_splits = [row[rank] for row in wire]
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8)
    dist.all_to_all_single(recv, send[: sum(send_splits)], recv_splits, send_splits)


def _bare_gather_scatter(inbound, outbound, rank: int, world: int, send: torch.Tensor) -> None:
    """Raw bytes to rank 0 and back (rank 0 keeps its own; others block on one recv)."""
    import torch.distributed as dist

    if rank == 0:
        bufs = {r: torch.empty(inbound[r], dtype=torch.uint8) for r in range(1, world) if inbound[r]}
        for req in [dist.irecv(b, src=r) for r, b in bufs.items()]:
            req.wait()
        out = torch.empty(max(outbound), dtype=torch.uint8)
        reqs = [dist.isend(out[: outbound[r]], dst=r) for r in range(1, world) if outbound[r]]
        for req in reqs:
            req.wait()
        return
    if inbound[rank]:
        dist.send(send[: inbound[rank]], dst=0)
    if outbound[rank]:
        dist.recv(torch.empty(outbound[rank], dtype=torch.uint8), src=0)


def _run_variant(name, batch, ctx):
    """One edge by ``name``; returns (this rank's seconds, counters or None, result or None)."""
    import torch.distributed as dist

    from distflow.data.counters import TransferCounters
    from distflow.data.centralized import exchange_centralized
    from distflow.data.exchange import exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    start = time.perf_counter()
    counters, result = None, None
    if name in ("distflow", "centralized", "distflow_exchange", "centralized_exchange"):
        counters = TransferCounters()
        if name.endswith("_exchange"):
            metadata, plan = ctx["metadata"], ctx["rank_plan" if name.startswith("distflow") else "plan"]
        else:
            metadata, plan = _plan_edge(batch, rank_plan=name == "distflow")
        run = exchange if name.startswith("distflow") else exchange_centralized
        result = run(batch, plan, None, counters, "advantage->actor", metadata=metadata)
    elif name == "bare_all_to_all":
        _bare_all_to_all(ctx["wire"], rank, ctx["send"])
    else:
        _bare_gather_scatter(ctx["inbound"], ctx["outbound"], rank, world, ctx["send"])
    return time.perf_counter() - start, counters, result


def _bare_bytes(ctx, rank: int) -> dict[str, int]:
    wire, inbound, outbound = ctx["wire"], ctx["inbound"], ctx["outbound"]
    a2a = sum(wire[rank]) + sum(row[rank] for row in wire)
    if rank == 0:
        gs = sum(inbound[1:]) + sum(outbound[1:])
    else:
        gs = inbound[rank] + outbound[rank]
    return {"bare_all_to_all": a2a, "bare_gather_scatter": gs}


def _same_result(a, b) -> bool:
    return (torch.equal(a.seq_lens, b.seq_lens)
            and all(torch.equal(a.token_fields[k], b.token_fields[k]) for k in a.token_fields)
            and all(torch.equal(a.sample_fields[k], b.sample_fields[k]) for k in a.sample_fields))


def _measure_length(nominal: int, samples_per_rank: int, repeats: int) -> dict:
    """All variants at one nominal length, alternated; medians of the slowest-rank times."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(sample_lengths(rank, samples_per_rank, nominal), rank)
    metadata, plan = _plan_edge(batch)
    wire, inbound, outbound = _byte_matrices(batch, plan, metadata.lengths)
    ctx = {"wire": wire, "inbound": inbound, "outbound": outbound, "metadata": metadata, "plan": plan,
           "rank_plan": plan.for_rank(rank),
           "send": torch.zeros(max(sum(wire[rank]), inbound[rank], 1), dtype=torch.uint8)}
    times = {v: [] for v in VARIANTS}
    bytes_through = _bare_bytes(ctx, rank)
    outputs = {}
    for rep in range(repeats + 1):  # repeat 0 warms up sockets and the allocator
        for name in rotated(VARIANTS, rep):
            seconds, counters, result = _run_variant(name, batch, ctx)
            seconds = max_over_ranks(seconds)
            if rep:
                times[name].append(seconds)
            if counters is not None:
                bytes_through[name] = counters.total_sent() + counters.total_received()
                outputs[name] = result
    identical = torch.tensor([int(_same_result(outputs["distflow"], outputs["centralized"]))])
    dist.all_reduce(identical, op=dist.ReduceOp.MIN)
    per_rank = torch.tensor([bytes_through[v] for v in VARIANTS], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    busiest = torch.stack(gathered).max(dim=0).values.tolist()
    plan_s = _time_planning(batch)
    latency_s = _allgather_latency()
    messages = count_messages(batch)
    phases = exchange_phases(batch, ctx)
    return {
        "nominal_tokens": nominal, "samples_per_rank": samples_per_rank,
        "total_bytes": sum(inbound), "moved_samples": plan.num_moved_samples(),
        "total_samples": world * samples_per_rank,
        "seconds": {v: median(t) for v, t in times.items()},
        "seconds_all": times,
        "busiest_rank_bytes": dict(zip(VARIANTS, busiest)),
        "identical_results": bool(identical.item()),
        "planning_seconds": plan_s,
        "allgather_seconds": latency_s,
        "messages_rank0": messages,
        "exchange_phases_rank0": phases,
    }


def _time_planning(batch, repeats: int = 5) -> float:
    """Median slowest-rank time of gather lengths + balance + this rank's plan (the distributed
    coordinator's planning) alone, no data moves."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _plan_edge(batch, rank_plan=True)
        times.append(max_over_ranks(time.perf_counter() - start))
    return median(times)


_COUNTED = ("all_gather", "all_gather_object", "all_to_all_single", "all_reduce", "broadcast",
            "send", "recv", "isend", "irecv")


def count_messages(batch) -> dict[str, dict[str, int]]:
    """torch.distributed calls made by one distflow edge and one centralized edge on this rank.

    Wraps the module's functions for the duration (exchange looks them up at
    call time), so the counts are what the product really issues.
    """
    import torch.distributed as dist

    counts: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    out = {}
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        for variant in ("distflow", "centralized"):
            counts.clear()
            _run_variant(variant, batch, {})
            counts.pop("all_reduce", None)  # _run_variant's own timing reduction is not the product's
            out[variant] = dict(counts)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


# exchange's own names for the wire functions it calls (distflow.data.wire), wrapped where it looks them up
_PHASES = {"checked_lengths": "metadata all-gathers", "pack_into": "pack", "all_to_all_single": "all_to_all",
           "assemble": "assemble", "rank_wire_sizes": "wire sizes"}


def exchange_phases(batch, ctx, repeats: int = 5) -> dict[str, float]:
    """Where one ``exchange`` call spends its time on this rank: median seconds per phase
    (wrapped exchange internals; the rest is Python bookkeeping)."""
    import torch.distributed as dist

    from distflow.data import exchange as xchg

    spent: dict[str, float] = {}
    targets = [(xchg, name) for name in _PHASES if name != "all_to_all_single"] + [(dist, "all_to_all_single")]
    originals = {(mod, name): getattr(mod, name) for mod, name in targets}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    runs = []
    try:
        for (mod, name), fn in originals.items():
            setattr(mod, name, timed(_PHASES[name], fn))
        for _ in range(repeats):
            spent.clear()
            dist.barrier()
            start = time.perf_counter()
            xchg.exchange(batch, ctx["rank_plan"], metadata=ctx["metadata"])
            runs.append({**spent, "total": time.perf_counter() - start})
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)
    return {k: median([r.get(k, 0.0) for r in runs]) for k in runs[0]}


def host_copy_throughput(num_samples: int = 64, nominal: int = 16384, repeats: int = 5) -> float:
    """Bytes/s of ``PackedBatch.select`` over a shuffled order (the gather copy that packing
    and assembly do), single thread, in this process."""
    import random

    torch.set_num_threads(1)
    batch = make_batch(sample_lengths(0, num_samples, nominal), 0)
    order = list(range(num_samples))
    random.Random(0).shuffle(order)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        batch.select(order)
        times.append(time.perf_counter() - start)
    return batch.nbytes / median(times[1:])


def _allgather_latency(repeats: int = 21) -> float:
    """Median slowest-rank time of one all_gather of 16 int64 per rank: the per-message cost."""
    import torch.distributed as dist

    mine = torch.zeros(16, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather(parts, mine)
        times.append(max_over_ranks(time.perf_counter() - start))
    return median(times)


def funnel_worker(rank: int, world: int, nominals: list[int], samples_per_rank: int, repeats: int) -> list[dict]:
    """Runs on every rank (spawned); rank 0's return value is the result."""
    torch.set_num_threads(1)
    return [_measure_length(n, samples_per_rank, repeats) for n in nominals]


def memory_worker(rank: int, world: int, nominal: int, samples_per_rank: int) -> dict:
    """Peak RSS growth of each rank during one distributed and one centralized edge.

    Runs in fresh processes with a fixed mmap threshold (set by the parent) so
    freed buffers go back to the OS and each peak is this edge's own.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    batch = make_batch(sample_lengths(rank, samples_per_rank, nominal), rank)
    out = {"batch_bytes": batch.nbytes}
    for name in ("distflow", "centralized"):
        dist.barrier()
        if not reset_peak_rss():
            return {"unsupported": True}
        before = peak_rss_bytes()
        _, _, result = _run_variant(name, batch, {})
        out[name] = peak_rss_bytes() - before
        del result
    return out


def run(world_sizes=(2, 4, 8), nominals=(1024, 4096, 16384, 32768), samples_per_rank: int = 16,
        repeats: int = 7, timeout_s: float = 900.0) -> dict:
    """The whole funnel benchmark: one spawn per world size, every length inside it."""
    from tests.dist._spawn import run_on_ranks

    results = {"samples_per_rank": samples_per_rank, "repeats": repeats,
               "bytes_per_token": BYTES_PER_TOKEN, "rows": [], "memory": {}}
    for world in world_sizes:
        rows = run_on_ranks(funnel_worker, world, list(nominals), samples_per_rank, repeats,
                            timeout_s=timeout_s)[0]
        results["rows"] += [{"world_size": world, **row} for row in rows]
    results["memory"] = run_memory(max(world_sizes), max(nominals), samples_per_rank, timeout_s)
    results["host_copy_bytes_per_s"] = host_copy_throughput()
    return results


def run_memory(world: int, nominal: int, samples_per_rank: int, timeout_s: float) -> dict:
    from tests.dist._spawn import run_on_ranks

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        per_rank = run_on_ranks(memory_worker, world, nominal, samples_per_rank, timeout_s=timeout_s)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return {"world_size": world, "nominal_tokens": nominal, "per_rank": per_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--lengths", default="1024,4096,16384,32768")
    parser.add_argument("--samples-per-rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    out = run(tuple(int(x) for x in args.world_sizes.split(",")),
              tuple(int(x) for x in args.lengths.split(",")), args.samples_per_rank, args.repeats)
    for row in out["rows"]:
        s, b = row["seconds"], row["busiest_rank_bytes"]
        print(f"N={row['world_size']} L={row['nominal_tokens']:>6}: "
              f"speedup {s['centralized'] / s['distflow']:.2f}x "
              f"(bare {s['bare_gather_scatter'] / s['bare_all_to_all']:.2f}x) "
              f"bytes ratio {b['distflow'] / b['centralized']:.3f} (1.25/N = {1.25 / row['world_size']:.3f}) "
              f"dist {s['distflow'] * 1e3:.1f} ms cent {s['centralized'] * 1e3:.1f} ms "
              f"a2a {s['bare_all_to_all'] * 1e3:.1f} ms gs {s['bare_gather_scatter'] * 1e3:.1f} ms "
              f"xchg {s['distflow_exchange'] * 1e3:.1f}/{s['centralized_exchange'] * 1e3:.1f} ms "
              f"plan {row['planning_seconds'] * 1e3:.1f} ms ag {row['allgather_seconds'] * 1e3:.2f} ms "
              f"identical={row['identical_results']}")
    print(json.dumps(out["memory"], indent=1))
    print("messages per edge (rank 0):", out["rows"][-1]["messages_rank0"])
    print(f"host copy throughput: {out['host_copy_bytes_per_s'] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
