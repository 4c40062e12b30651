"""A shortened quickstart (examples/quickstart.yaml, or another example) through the CLI, as a
subprocess; its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_quickstart(log_dir: Path, overrides: list[str], timeout_s: float = 1500.0,
                   example: str = "quickstart.yaml") -> list[dict]:
    """``distflow run examples/<example> --set ...`` with this interpreter; the metrics.jsonl rows.

    Raises:
        RuntimeError: the run failed (the tail of its output in the message).
    """
    sets = [f"trainer.logDir={log_dir}", "checkpoint.dir=null"] + overrides
    cmd = [sys.executable, "-m", "distflow.cli", "run", str(REPO / "examples" / example),
           "--no-resume"] + [arg for s in sets for arg in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator")]),
           "DISTFLOW_JOB_NAME": f"vllm-tier-{log_dir.name}"}
    proc = subprocess.run(cmd, env=env, cwd=log_dir.parent, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{example} {overrides} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}")
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
