"""The prepared GPU check: one command, under 10 minutes, results under docs/benchmarks/.

    python -m tests.bench.gpu_check                        # a GPU box: the repo and its .venv
    python -m tests.bench.gpu_check --device cpu --quick --out-dir DIR   # dry run (tests/dist)

Writes ``gpu-<date>.json`` and ``gpu-<date>.md`` to ``--out-dir`` (default
docs/benchmarks; also to ``$OUT`` when set). Every part runs in the dry mode
too, on CPU with gloo and tiny sizes, so a test keeps this script from rotting.
A part that fails records its error and the rest still run; a part that would
overrun the time budget is skipped with the reason.

1. ``device_copy``: device-to-device copy bandwidth (and pinned/pageable host copies on CUDA).
2. ``exchange``: the funnel edge (tests/bench/funnel.py) over NCCL, one rank per
   GPU (needs >= 2: NCCL refuses two ranks on one GPU): every sample checked
   bit-identical at its destination, the node buffer left unused (intra-node
   pieces go over NCCL), and the edge's time against the bare
   ``all_to_all_single`` of the same bytes (target: <= 1.25x) and against the
   centralized edge.
3. ``shared_attention``: log-prob forward time and peak memory of the per-sample
   path, the dense-mask shared-prompt path and FlexAttention's block mask
   (tests/bench/shared_attention.py), with gradients compared on CUDA.
4. ``grpo``: ``distflow run`` of 2 GRPO steps over NCCL, one worker per GPU,
   on SmolLM2 and on the largest random Llama whose training state fits
   (7B, 3B or 1.5B shapes): tokens/s, peak device memory (sampled from the
   driver while it runs), FSDP weight all-gather bytes.
5. ``vllm``: ``tests/bench/gpu_vllm.py``'s measurement, when that module exists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from tests.bench._common import FIGURES_DIR, median

CHECK_BYTES_PER_PARAM = 18
"""Training state per parameter with fp32 master weights: weights, gradients and
two AdamW moments (16 B), plus a bf16 reference model (2 B); activations and the
rollout come on top, hence the 0.8 of device memory ``pick_model_size`` leaves."""

LLAMA_SIZES = {  # name -> (hidden, intermediate, layers, heads, kv heads): Llama-2-7B, Llama-3.2-3B, Qwen2-1.5B shapes
    "7b": (4096, 11008, 32, 32, 32),
    "3b": (3072, 8192, 28, 24, 8),
    "1.5b": (1536, 8960, 28, 12, 2),
}
QUICK_SIZE = (64, 128, 2, 4, 2)
"""The dry run's "large" model: the same code path at toy size."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (synchronised, one warm-up call)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def device_copy(device: torch.device, quick: bool) -> dict:
    nbytes = (1 << 20) if quick else (1 << 30)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = {"bytes": nbytes, "d2d_bytes_per_s": nbytes / timed(lambda: dst.copy_(src), device, 10)}
    if device.type == "cuda":
        pinned, pageable = torch.empty(nbytes, dtype=torch.uint8).pin_memory(), torch.empty(nbytes, dtype=torch.uint8)
        out["h2d_pinned_bytes_per_s"] = nbytes / timed(lambda: dst.copy_(pinned, non_blocking=True), device, 10)
        out["h2d_pageable_bytes_per_s"] = nbytes / timed(lambda: dst.copy_(pageable), device, 3)
    return out


def pick_model_size(free_bytes: int, world: int, quick: bool) -> tuple[str, tuple]:
    """The largest of ``LLAMA_SIZES`` whose FSDP-sharded training state fits 0.8 of a device."""
    if quick:
        return "quick", QUICK_SIZE
    for name, shape in LLAMA_SIZES.items():
        if llama_params(shape, 49152) * CHECK_BYTES_PER_PARAM / world <= 0.8 * free_bytes:
            return name, shape
    return "1.5b", LLAMA_SIZES["1.5b"]


def llama_params(shape: tuple, vocab: int) -> int:
    hidden, inter, layers, heads, kv = shape
    head_dim = hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    return layers * (attention + 3 * hidden * inter + 2 * hidden) + 2 * vocab * hidden + hidden


def write_random_model(shape: tuple, tokenizer_dir: Path, out_dir: Path, device: torch.device) -> Path:
    """A randomly initialised Llama of ``shape`` (bf16 safetensors) with the tokenizer of
    ``tokenizer_dir``, built on ``device`` (a 7B init takes minutes on host cores)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from distflow.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    hidden, inter, layers, heads, kv = shape
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_dir


class MemorySampler:
    """Peak memory in use while a run lasts, sampled every 50 ms: on CUDA the driver's
    used bytes per device (every process on it), on CPU the host's (MemTotal - MemAvailable)."""

    def __init__(self, device: torch.device) -> None:
        import threading

        self.device, self.peak, self._stop = device, {}, threading.Event()
        self.baseline = self._used()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {f"cuda:{i}": (lambda f, t: t - f)(*torch.cuda.mem_get_info(i))
                    for i in range(torch.cuda.device_count())}
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return {"host": (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024}

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, used in self._used().items():
                self.peak[name] = max(self.peak.get(name, 0), used)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self) -> dict[str, int]:
        """Peak bytes above the baseline, per device."""
        return {k: max(0, v - self.baseline.get(k, 0)) for k, v in self.peak.items()}


def grpo_run(model_path: str, device: torch.device, workers: int, quick: bool, dtype: str) -> dict:
    """2 GRPO steps through the local launcher; tokens/s, peak memory, and the all-gather and
    reduce-scatter bytes each step counted by the runtime (``perf/allgather_bytes``,
    ``perf/reduce_scatter_bytes``: busiest rank)."""
    from distflow.launcher import launch_local
    from distflow.metrics import read_jsonl
    from distflow.spec import parse_spec

    per_worker = 2 if quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        spec = parse_spec({
            "model": {"path": model_path, "dtype": dtype},
            "data": {"train": {"path": "arithmetic", "size": 256}, "trainBatchSize": per_worker * workers // 2,
                     "maxPromptLength": 64, "maxResponseLength": 8 if quick else 128},
            "rollout": {"n": 2}, "algorithm": {"useKlLoss": True},
            "cluster": {"numNodes": 1, "procsPerNode": workers, "device": device.type},
            "trainer": {"totalSteps": 2, "logDir": tmp},
        })
        start = time.perf_counter()
        with MemorySampler(device) as memory:
            launch_local(spec, "gpu-check", resume=False, progress=False)
        records = read_jsonl(Path(tmp) / "metrics.jsonl")
    wall = time.perf_counter() - start
    steps = [{k: v for k, v in r.items() if k in ("timing_s/step", "perf/throughput", "perf/total_num_tokens",
                                                   "actor/grad_norm") or "gather" in k or "scatter" in k or "sync" in k}
                 for r in records]
    tokens = sum(r.get("perf/total_num_tokens", 0) for r in records)
    step_time = sum(r.get("timing_s/step", 0) for r in records)
    return {"model": model_path, "workers": workers, "dtype": dtype, "wall_seconds": wall, "steps": steps,
            "tokens_per_s": tokens / step_time if step_time else None,
            "peak_memory_growth_bytes": memory.growth()}


def weight_allgather_bytes(model_dir: Path, workers: int, gather_itemsize: int) -> dict:
    """What FSDP2 should all-gather per rank in one forward + backward of the update with the
    default layout (the full parameters twice: forward, then the backward's re-gather), from the
    parameter count: the expectation beside the runtime's counted ``perf/allgather_bytes``."""
    config = json.loads((model_dir / "config.json").read_text())
    shape = (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
             config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]))
    params = llama_params(shape, config["vocab_size"])
    return {"parameters": params, "gather_itemsize": gather_itemsize,
            "expected_allgather_bytes_per_update_pass": int(2 * params * gather_itemsize)}


def grpo(device: torch.device, quick: bool, budget) -> dict:
    """``grpo_run`` on SmolLM2 (a tiny model in the dry run), then on the largest random Llama that fits."""
    from distflow.models import resolve_model
    from distflow.models import model_cache_dir

    workers = torch.cuda.device_count() if device.type == "cuda" else 1  # the exchange part runs 2 CPU ranks
    first = "tiny:byte" if quick else "smollm2"
    out = {"smollm2": _part(lambda: grpo_run(first, device, workers, quick, "float32"), budget, 120)}
    free = torch.cuda.mem_get_info(0)[0] if device.type == "cuda" else 0
    name, shape = pick_model_size(free, workers, quick)
    with tempfile.TemporaryDirectory() as tmp:
        def large() -> dict:
            model_dir = write_random_model(shape, resolve_model(first, model_cache_dir()), Path(tmp), device)
            result = grpo_run(str(model_dir), device, workers, quick, "bfloat16")
            return {"size": name, **weight_allgather_bytes(model_dir, workers, 2), **result}

        out["large"] = _part(large, budget, 240)
    return out


def _part(fn, budget, needs_s: float) -> dict:
    """Run one part unless fewer than ``needs_s`` seconds of the budget are left; errors are recorded."""
    left = budget()
    if left < needs_s:
        return {"skipped": f"{left:.0f} s of the time budget left; this part needs about {needs_s:.0f} s"}
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001  (a one-shot GPU run keeps going and reports)
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
    return {**result, "part_seconds": time.perf_counter() - start} if isinstance(result, dict) else result


def vllm_check(device: torch.device, quick: bool) -> dict:
    import inspect

    try:
        from tests.bench import gpu_vllm
    except ImportError:
        return {"skipped": "tests/bench/gpu_vllm.py is not in this checkout"}
    if not hasattr(gpu_vllm, "run"):
        return {"skipped": "tests/bench/gpu_vllm.py has no run()"}
    offered = {"device": device.type, "quick": quick}
    accepted = inspect.signature(gpu_vllm.run).parameters
    return gpu_vllm.run(**{k: v for k, v in offered.items() if k in accepted})


def shared_attention(device: torch.device, quick: bool) -> dict:
    from tests.bench import shared_attention as bench

    if quick:  # eager FlexAttention's first call traces for a minute on two cores: the unit tests cover it
        return bench.run(lengths=(16,), prompt_len=8, n=2, repeats=1, num_layers=1, device=device.type,
                         flex_max_len=0, grad_check=True)
    return bench.run(lengths=(256, 1024, 2048), repeats=3, num_layers=4, device=device.type, vocab_size=49152)


def run(device: torch.device, quick: bool, budget_s: float) -> dict:
    from tests.bench.gpu_exchange import exchange_check

    deadline = time.monotonic() + budget_s
    budget = lambda: deadline - time.monotonic()  # noqa: E731
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "device_count": torch.cuda.device_count() if device.type == "cuda" else 0,
           "torch": torch.__version__, "quick": quick}
    if device.type == "cuda":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out["device_copy"] = _part(lambda: device_copy(device, quick), budget, 5)
    out["exchange"] = _part(lambda: exchange_check(device, quick), budget, 60)
    out["shared_attention"] = _part(lambda: shared_attention(device, quick), budget, 60)
    out["grpo"] = grpo(device, quick, budget)
    out["vllm"] = _part(lambda: vllm_check(device, quick), budget, 60)
    return out


def markdown(result: dict) -> str:
    """The headline figures as a short page; the JSON beside it has everything."""
    from tests.bench.gpu_exchange import exchange_table
    from tests.bench.shared_attention import table

    lines = [f"# GPU check, {result['date']}", "",
             f"{result['device']} x {result['device_count']}, torch {result['torch']}"
             + (f", NCCL {result['nccl']}" if "nccl" in result else "") + (" (dry run)" if result["quick"] else ""),
             "", "## Exchange (funnel edge)", "", exchange_table(result["exchange"]), "",
             "## Shared-prompt attention (log-prob forward)", ""]
    attention = result["shared_attention"]
    lines.append(table(attention) if "rows" in attention else f"`{_why(attention)}`")
    lines += ["", "## GRPO, 2 steps", "", "| run | model | workers | tokens/s | peak memory growth GiB | "
              "weight all-gather B/rank/pass | wall s |", "|---|---|---|---|---|---|---|"]
    for name, run_out in result["grpo"].items():
        if "steps" not in run_out:
            lines.append(f"| {name} | `{_why(run_out)}` | | | | | |")
            continue
        peak = max(run_out["peak_memory_growth_bytes"].values(), default=0) / 2**30
        gather = run_out.get("per_rank_bytes_per_update_pass", "-")
        lines.append(f"| {name} | {run_out.get('size', run_out['model'])} | {run_out['workers']} "
                     f"| {run_out['tokens_per_s'] or 0:.0f} | {peak:.2f} | {gather} | {run_out['wall_seconds']:.0f} |")
    lines += ["", f"vLLM: `{_why(result['vllm']) or 'measured (see JSON)'}`", ""]
    return "\n".join(lines)


def _why(part: dict) -> str:
    return part.get("skipped") or part.get("error") or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the dry run of every part")
    parser.add_argument("--out-dir", default=str(FIGURES_DIR))
    parser.add_argument("--budget-s", type=float, default=540.0, help="parts that would overrun are skipped")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; for a dry run pass --device cpu --quick")
    result = run(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"),
                 args.quick, args.budget_s)
    stem = f"gpu-{result['date'][:10]}" + ("-dry" if args.device == "cpu" else "")
    outs = [Path(args.out_dir)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
