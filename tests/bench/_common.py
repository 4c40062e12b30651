"""Shared benchmark plumbing: timing across ranks, statistics, machine facts, peak memory.

Every benchmark measures the things it compares side by side in one run,
alternating them (round-robin, with the start rotated each repeat) and
keeping the median, because this machine is shared and its load drifts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS_DIR = REPO_ROOT / "docs"
FIGURES_DIR = DOCS_DIR / "benchmarks"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rotated(items: Sequence, shift: int) -> list:
    """``items`` started at ``shift`` (mod len): repeat k runs variant k first, so no
    variant always pays for a cold cache or always follows the same one."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def max_over_ranks(seconds: float, group=None) -> float:
    """The slowest rank's time: a collective step ends when its last rank does."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value)


def peak_rss_bytes(pid: int | str = "self") -> int:
    """VmHWM (peak resident set) of a process, in bytes; 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux clear_refs "5"); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def machine_info() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_env() -> dict:
    """The environment of a benchmark's child process: this checkout first on PYTHONPATH."""
    paths = [str(REPO_ROOT / "worker_image"), str(REPO_ROOT / "operator"), str(REPO_ROOT)]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
            "TOKENIZERS_PARALLELISM": "false"}


def run_distflow_job(config: Path, args: Sequence[str], log_dir: Path, job_name: str, workdir: Path,
                     timeout_s: float) -> tuple[list[dict], float]:
    """``distflow run CONFIG --no-resume ARGS`` in a child process.

    Returns:
        The run's metrics.jsonl records (in ``log_dir``) and its wall time in seconds.

    Raises:
        RuntimeError: the run exited non-zero (with the end of its stderr).
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "run", str(config), "--no-resume", *args],
                          env={**bench_env(), "DISTFLOW_JOB_NAME": job_name}, cwd=workdir,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{job_name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return records, time.perf_counter() - start
