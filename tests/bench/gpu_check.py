"""GPU check (< 10 minutes): redistribution over NCCL against the device's own copy bandwidth,
and one GRPO training step on CUDA.

    python -m tests.bench.gpu_check --out docs/benchmarks/gpu_results.json

Measures, on the visible GPUs:

1. ``device_copy``: device-to-device ``copy_`` of 1 GiB (bytes copied / s),
   and host<->device copies (pinned and pageable: the coordinator stages
   batches with a plain ``.to(device)``, i.e. pageable).
2. ``pack``: ``PackedBatch.select`` on the device (the gather copy that
   ``exchange`` packs and assembles with), as bytes/s and as a fraction of
   the device copy bandwidth.
3. ``redistribution`` (needs >= 2 GPUs; NCCL refuses two ranks on one GPU):
   the funnel benchmark's edge on NCCL, distflow ``exchange`` vs
   ``exchange_centralized`` vs a bare ``all_to_all_single``, per-rank bytes /
   s of the busiest rank against the device copy bandwidth.
4. ``train_step``: ``distflow run`` of 2 GRPO steps of a tiny random model
   on CUDA (one worker per GPU, up to 2), through the local launcher.

Writes JSON (with the date) to ``--out`` and prints it. Nothing here is
needed for the CPU test suite; the report renders the JSON when present.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from tests.bench._common import REPO_ROOT, median
from tests.bench.funnel import make_batch, sample_lengths


def _cuda_seconds(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn`` on the current device (synchronised, one warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


def device_copy(nbytes: int = 1 << 30) -> dict:
    dev = torch.cuda.current_device()
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host_pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host = torch.empty(nbytes, dtype=torch.uint8)
    return {
        "bytes": nbytes,
        "d2d_bytes_per_s": nbytes / _cuda_seconds(lambda: dst.copy_(src)),
        "h2d_pinned_bytes_per_s": nbytes / _cuda_seconds(lambda: dst.copy_(host_pinned, non_blocking=True)),
        "d2h_pinned_bytes_per_s": nbytes / _cuda_seconds(lambda: host_pinned.copy_(src, non_blocking=True)),
        "h2d_pageable_bytes_per_s": nbytes / _cuda_seconds(lambda: dst.copy_(host), repeats=3),
    }


def pack_throughput(copy_bps: float, num_samples: int = 64, nominal: int = 32768) -> dict:
    batch = make_batch(sample_lengths(0, num_samples, nominal), 0)
    dev = torch.device("cuda", torch.cuda.current_device())
    on_device = type(batch)(batch.seq_lens, {k: v.to(dev) for k, v in batch.token_fields.items()},
                            {k: v.to(dev) for k, v in batch.sample_fields.items()})
    order = list(range(num_samples))[::-1]
    seconds = _cuda_seconds(lambda: on_device.select(order))
    return {"bytes": batch.nbytes, "bytes_per_s": batch.nbytes / seconds,
            "fraction_of_copy": batch.nbytes / seconds / copy_bps}


def _nccl_worker(rank: int, world: int, port: int, nominals, samples_per_rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.bench.funnel import _byte_matrices, _plan_edge

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    rows = []
    for nominal in nominals:
        cpu = make_batch(sample_lengths(rank, samples_per_rank, nominal), rank)
        batch = type(cpu)(cpu.seq_lens, {k: v.to(dev) for k, v in cpu.token_fields.items()},
                          {k: v.to(dev) for k, v in cpu.sample_fields.items()})
        lengths, plan = _plan_edge(batch)
        wire, inbound, _ = _byte_matrices(batch, plan, lengths)
        variants = _nccl_variants(batch, plan, lengths, wire, rank, dev)
        times = {name: _synced_max(fn, dist) for name, fn in variants.items()}
        busiest = max(sum(wire[r]) + sum(row[r] for row in wire) for r in range(world))
        rows.append({"nominal_tokens": nominal, "total_bytes": sum(inbound), "busiest_rank_bytes": busiest,
                     "seconds": times,
                     "busiest_bytes_per_s": {k: busiest / v for k, v in times.items()}})
    if rank == 0:
        Path(out_dir, "nccl.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _nccl_variants(batch, plan, lengths, wire, rank: int, dev) -> dict:
    """name -> callable running one edge: distflow, centralized, and the bare collective."""
    import torch.distributed as dist

    from distflow.data.exchange import exchange, exchange_centralized

    send_splits, recv_splits = wire[rank], [row[rank] for row in wire]
    send = torch.zeros(max(sum(send_splits), 1), dtype=torch.uint8, device=dev)
    recv = torch.empty(max(sum(recv_splits), 1), dtype=torch.uint8, device=dev)

    def bare():
        dist.all_to_all_single(recv[: sum(recv_splits)], send[: sum(send_splits)], recv_splits, send_splits)

    return {"distflow": lambda: exchange(batch, plan, all_lengths=lengths),
            "centralized": lambda: exchange_centralized(batch, plan, all_lengths=lengths),
            "bare_all_to_all": bare}


def _synced_max(fn, dist, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], device="cuda")
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return median(times[1:])


def redistribution(nominals=(4096, 16384, 32768), samples_per_rank: int = 32) -> dict:
    import torch.multiprocessing as mp

    from tests.dist._spawn import free_port

    world = torch.cuda.device_count()
    if world < 2:
        return {"skipped": f"{world} GPU visible; NCCL needs one GPU per rank, so at least 2"}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(world, free_port(), list(nominals), samples_per_rank, tmp),
                 nprocs=world, join=True)
        return {"world_size": world, "rows": json.loads(Path(tmp, "nccl.json").read_text())}


def train_step(steps: int = 2) -> dict:
    """``distflow run`` on CUDA with a tiny model (no downloads), via the local launcher."""
    from distflow.launcher import launch_local
    from distflow.metrics import read_jsonl
    from distflow.spec import parse_spec

    workers = min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec({
            "model": {"path": "tiny:byte"},
            "data": {"train": {"path": "arithmetic", "size": 256}, "trainBatchSize": 4 * workers,
                     "maxPromptLength": 64, "maxResponseLength": 16},
            "rollout": {"n": 4}, "algorithm": {"useKlLoss": True},
            "cluster": {"numNodes": 1, "procsPerNode": workers, "device": "cuda"},
            "trainer": {"totalSteps": steps, "logDir": tmp},
        })
        start = time.perf_counter()
        launch_local(spec, "gpu-check", resume=False, progress=False)
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
    return {"workers": workers, "wall_seconds": time.perf_counter() - start,
            "steps": [{k: r[k] for k in ("timing_s/step", "perf/throughput", "actor/grad_norm") if k in r}
                      for r in records]}


def run() -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "torch.cuda.is_available() is False"}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count(),
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    out["device_copy"] = device_copy()
    out["pack"] = pack_throughput(out["device_copy"]["d2d_bytes_per_s"])
    out["redistribution"] = redistribution()
    out["train_step"] = train_step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "benchmarks" / "gpu_results.json"))
    args = parser.parse_args()
    result = run()
    text = json.dumps(result, indent=1)
    print(text)
    if "skipped" in result:
        return  # keep any earlier GPU results: this machine measured nothing
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_results.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
