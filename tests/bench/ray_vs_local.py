"""The quickstart under the local launcher and under `--ray` on a two-node Ray cluster, side by side.

    python -m tests.bench.ray_vs_local [--steps N] [--repeats K]

Both runs are the same command, `distflow run examples/quickstart.yaml
--no-resume`, with logs and checkpoints in a temporary directory; the Ray
one adds `--ray ADDRESS` of a Ray cluster this script starts on this
machine (Ray's ``cluster_utils.Cluster``: a head and one more Ray node, one
CPU each, so each quickstart node is one Ray node). They alternate, the
first one rotated each repeat (tests/bench/_common.py), because the machine
is shared. Reported per launcher: wall time of the whole command, the sum
of the step times the workers measured (``timing_s/step``) and the rest
(start-up: process or actor start, model load, eval and checkpoints), and
the final eval score, which must be the same under both launchers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench._common import REPO_ROOT, median, rotated

QUICKSTART = REPO_ROOT / "examples" / "quickstart.yaml"


def run_quickstart(workdir: Path, steps: int | None, ray_address: str | None) -> dict[str, float]:
    """One `distflow run` of the quickstart; its wall time, summed step time and last eval score."""
    overrides = [f"trainer.logDir={workdir}/logs", f"checkpoint.dir={workdir}/checkpoints"]
    if steps:
        overrides.append(f"trainer.totalSteps={steps}")
    cmd = [sys.executable, "-m", "distflow.cli", "run", str(QUICKSTART), "--no-resume"]
    cmd += [arg for value in overrides for arg in ("--set", value)]
    if ray_address:
        cmd += ["--ray", ray_address]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    records = [json.loads(line) for line in (workdir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    steps_s = sum(r["timing_s/step"] for r in records if "timing_s/step" in r)
    evals = [r["eval/score"] for r in records if "eval/score" in r]
    return {"wall_s": wall, "steps_s": steps_s, "other_s": wall - steps_s, "eval_score": evals[-1] if evals else float("nan"),
            "num_steps": max(r["training/step"] for r in records)}


def two_node_ray_cluster():
    """A head and one more Ray node with one CPU each, loopback only."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1 (inherited by the raylets)
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024**2}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="trainer.totalSteps (default: the quickstart's)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    cluster = two_node_ray_cluster()
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        for repeat in range(args.repeats):
            for launcher in rotated(["local", "ray"], repeat):
                with tempfile.TemporaryDirectory(prefix=f"distflow-{launcher}-") as tmp:
                    address = cluster.address if launcher == "ray" else None
                    results[launcher].append(run_quickstart(Path(tmp), args.steps, address))
                    print(f"{launcher}: {results[launcher][-1]}", flush=True)
    finally:
        cluster.shutdown()
    summary = {launcher: {key: median([run[key] for run in runs]) for key in runs[0]}
               for launcher, runs in results.items()}
    print("| launcher | wall (s) | sum of step times (s) | rest: start-up, eval, checkpoints (s) | steps | final eval |")
    print("|---|---|---|---|---|---|")
    for launcher, row in summary.items():
        print(f"| {launcher} | {row['wall_s']:.1f} | {row['steps_s']:.1f} | {row['other_s']:.1f} | "
              f"{row['num_steps']:.0f} | {row['eval_score']:.3f} |")
    return summary


if __name__ == "__main__":
    main()
