"""Peak resident memory of every worker over a (shortened) quickstart run, both data planes.

``distflow run examples/quickstart.yaml`` (2 local workers: SmolLM2-135M,
GRPO) is started as a subprocess with ``trainer.totalSteps`` cut to a few
steps and no eval or checkpoints; a sampler thread reads every descendant
worker's ``/proc/<pid>/status`` 20 times a second: VmHWM (the kernel's peak
RSS) and RssAnon / RssFile (anonymous vs file-backed pages, e.g. mmapped
safetensors and shared libraries). Workers are ordered by start time (the
local launcher starts rank 0 first). Distributed and centralized runs
alternate.

What a worker needs (the issue's yardstick), for P parameters and W workers,
fp32 weights and Adam: full weights for the rollout 4P (all-gathered from the
actor's shards, or a separate copy) + actor shard 4P/W + gradient shard
4P/W + Adam moments 8P/W bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.bench._common import REPO_ROOT, median


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _is_worker(proc) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # the process may be gone already
        return False
    return "spawn_main" in cmd and "resource_tracker" not in cmd


class PeakSampler(threading.Thread):
    """Polls the workers under ``root_pid``: per-pid max of each memory counter."""

    def __init__(self, root_pid: int, period_s: float = 0.05):
        super().__init__(daemon=True)
        self.root_pid, self.period_s = root_pid, period_s
        self.peaks: dict[int, dict[str, int]] = {}
        self.started: dict[int, float] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.root_pid)
        while not self.stop_event.is_set():
            try:
                children = root.children(recursive=True)
            except psutil.Error:
                return
            for child in children:
                if child.pid not in self.started:
                    if not _is_worker(child):
                        continue
                    self.started[child.pid] = child.create_time()
                peak = self.peaks.setdefault(child.pid, {})
                for key, value in _status(child.pid).items():
                    peak[key] = max(peak.get(key, 0), value)
            time.sleep(self.period_s)

    def per_rank(self) -> list[dict[str, int]]:
        return [self.peaks[pid] for pid in sorted(self.started, key=self.started.get)]


def quickstart_peaks(mode: str, steps: int, workdir: Path, timeout_s: float) -> dict:
    """One shortened quickstart run in ``mode``; per-worker peaks and the run's wall time."""
    log_dir = workdir / f"quickstart-{mode}-{time.monotonic_ns()}"
    overrides = [f"trainer.totalSteps={steps}", "data.eval=null", "checkpoint.dir=null",
                 f"trainer.logDir={log_dir}", f"dataPlane.mode={mode}"]
    cmd = [sys.executable, "-m", "distflow.cli", "run", str(REPO_ROOT / "examples" / "quickstart.yaml"),
           "--no-resume"] + [arg for o in overrides for arg in ("--set", o)]
    paths = [str(REPO_ROOT / "worker_image"), str(REPO_ROOT / "operator"), str(REPO_ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "DISTFLOW_JOB_NAME": f"bench-mem-{mode}"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    sampler = PeakSampler(proc.pid)
    sampler.start()
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        sampler.stop_event.set()
        sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"quickstart ({mode}) failed ({proc.returncode}):\n{stderr[-4000:]}")
    return {"per_rank": sampler.per_rank(), "wall_seconds": time.perf_counter() - start}


def need_bytes(num_params: int, world_size: int) -> int:
    """Full rollout weights + actor, gradient and Adam shards, fp32 (see module docstring)."""
    return 4 * num_params + (4 + 4 + 8) * num_params // world_size


def smollm2_num_parameters() -> int:
    from distflow.models import load_causal_lm, num_parameters, resolve_model
    from distflow.models import model_cache_dir

    return num_parameters(load_causal_lm(resolve_model("smollm2", model_cache_dir())))


def run(steps: int = 2, rounds: int = 1, timeout_s: float = 1200.0) -> dict:
    """Alternating distributed / centralized quickstart runs; per-rank peaks of each."""
    from distflow.spec import load_job_spec

    spec = load_job_spec(REPO_ROOT / "examples" / "quickstart.yaml")
    runs = {"distributed": [], "centralized": []}
    with tempfile.TemporaryDirectory(prefix="distflow-bench-mem-") as tmp:
        for k in range(rounds):
            for mode in ("distributed", "centralized") if k % 2 == 0 else ("centralized", "distributed"):
                runs[mode].append(quickstart_peaks(mode, steps, Path(tmp), timeout_s))
    params = smollm2_num_parameters()
    return {"steps": steps, "rounds": rounds, "world_size": spec.world_size, "num_params": params,
            "need_bytes": need_bytes(params, spec.world_size), "runs": runs,
            "summary": {mode: summarize(items) for mode, items in runs.items()}}


def summarize(items: list[dict]) -> dict:
    """Per rank: the largest VmHWM over the rounds; spread of the ranks' peaks."""
    ranks = len(items[0]["per_rank"])
    peaks = [max(r["per_rank"][i].get("VmHWM", 0) for r in items) for i in range(ranks)]
    anon = [max(r["per_rank"][i].get("RssAnon", 0) for r in items) for i in range(ranks)]
    return {"peak_rss": peaks, "peak_anon": anon, "max_over_median": max(peaks) / median(peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(run(args.steps, args.rounds), indent=1))


if __name__ == "__main__":
    main()
