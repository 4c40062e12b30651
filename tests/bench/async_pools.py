"""Sync vs asynchronous (``async.maxStaleness: 1``) on the quickstart: overlap and convergence.

Both run examples/quickstart.yaml (SmolLM2-135M-Instruct, GRPO on small-number
arithmetic, 2 CPU workers x 1 thread, the same total workers):

- sync: both workers generate, then both train (FSDP2 over 2);
- async: worker 0 trains (FSDP2 over 1), worker 1 generates with its own
  replica one step ahead (truncated importance sampling on the stale samples,
  cap 2), the weights synced after every step.

Runs alternate (sync, async, async, sync, sync, async, ...), seeds 0 to 4 for each,
``steps`` steps each with a held-out evaluation (``rollout.val``: ``eval_prompts``
prompts x 4 samples, twice the quickstart's 48: at 48 the score's sampling noise
was as wide as the seeds' spread) every ``eval_every`` steps. Reported:

(a) the step time against its floor: for async, each step's wall time over
    max(generation time of the rollout pool, training time of the trainer pool)
    of that step (target <= 1.1: the two pools really overlap); medians over the
    steps after the first two (warm-up, and the pipeline filling);
(b) convergence: the held-out score curve of every run, the mean per mode,
    whether async stays within the spread (min..max over seeds) of sync, and
    whether it is at least sync's worst seed (no worse than sync).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.bench._common import REPO_ROOT, median, run_distflow_job

QUICKSTART = REPO_ROOT / "examples" / "quickstart.yaml"


@dataclass(frozen=True)
class Settings:
    steps: int = 20
    eval_every: int = 5
    eval_prompts: int = 96
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # with 3, the spread was narrower than the run-to-run change
    max_staleness: int = 1
    warmup_steps: int = 2


def _overrides(s: Settings, mode: str, seed: int, log_dir: Path) -> list[str]:
    sets = {"trainer.totalSteps": s.steps, "trainer.evalEverySteps": s.eval_every, "trainer.seed": seed,
            "trainer.logDir": str(log_dir), "checkpoint.dir": str(log_dir / "checkpoints"),
            "checkpoint.saveEverySteps": 0, "cluster.numNodes": 2, "trainer.numThreads": 1,
            "data.eval.size": s.eval_prompts}
    if mode == "async":
        sets.update({"async.enable": "true", "async.maxStaleness": s.max_staleness,
                     "async.rolloutPool.numNodes": 1})
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def run_one(s: Settings, mode: str, seed: int, workdir: Path, timeout_s: float = 3600) -> dict:
    """One ``distflow run`` of the quickstart; its per-step timings and held-out scores."""
    log_dir = workdir / f"{mode}-seed{seed}"
    records, wall = run_distflow_job(QUICKSTART, _overrides(s, mode, seed, log_dir), log_dir,
                                     f"bench-{mode}-{seed}", workdir, timeout_s)
    steps = [r for r in records if "timing_s/step" in r]
    evals = [(int(r["training/step"]), r["eval/score"]) for r in records if "eval/score" in r]
    out = {"step_seconds": [r["timing_s/step"] for r in steps], "eval": evals,
           "reward": [r.get("critic/score/mean", 0.0) for r in steps],
           "wall_seconds": wall}
    if mode == "async":
        out["generate_seconds"] = [r["timing_s/generate"] for r in steps]
        out["train_seconds"] = [r["timing_s/train"] for r in steps]
        out["staleness_max"] = max(r["async/staleness_max"] for r in steps)
    else:
        gen = [k for k in steps[0] if k == "timing_s/rollout"]
        out["generate_seconds"] = [r[gen[0]] for r in steps] if gen else []
    return out


def summarize(s: Settings, runs: dict[str, list[dict]]) -> dict:
    """Medians of (a) and the spread check of (b) (pure; the tests feed it made-up runs)."""
    skip = s.warmup_steps
    summary = {}
    for mode, rs in runs.items():
        steps = [t for r in rs for t in r["step_seconds"][skip:]]
        summary[mode] = {"median_step_seconds": median(steps)}
    floors = [t / max(g, tr) for r in runs["async"]
              for t, g, tr in list(zip(r["step_seconds"], r["generate_seconds"], r["train_seconds"]))[skip:]]
    summary["async"]["median_step_over_floor"] = median(floors)
    summary["async"]["median_generate_seconds"] = median(
        [g for r in runs["async"] for g in r["generate_seconds"][skip:]])
    summary["async"]["median_train_seconds"] = median([t for r in runs["async"] for t in r["train_seconds"][skip:]])
    summary["speedup"] = summary["sync"]["median_step_seconds"] / summary["async"]["median_step_seconds"]
    curves = {mode: {step: [dict(r["eval"])[step] for r in rs] for step, _ in rs[0]["eval"]}
              for mode, rs in runs.items()}
    within, not_below = {}, {}
    for step, sync_scores in curves["sync"].items():
        mean_async = sum(curves["async"][step]) / len(curves["async"][step])
        within[step] = min(sync_scores) <= mean_async <= max(sync_scores)
        not_below[step] = mean_async >= min(sync_scores)
    summary["curves"] = {mode: {str(k): v for k, v in c.items()} for mode, c in curves.items()}
    summary["async_mean_within_sync_spread"] = {str(k): v for k, v in within.items()}
    # one-sided: async converges no worse than sync's worst seed (above the spread is not a loss)
    summary["async_mean_at_least_sync_min"] = {str(k): v for k, v in not_below.items()}
    summary["final_step"] = max(curves["sync"])
    return summary


def summary_of(result: dict) -> dict:
    """``summarize`` of a saved result (its settings and runs), so a re-render shows every figure
    the current ``summarize`` computes, also for results saved before it computed them."""
    s = result["settings"]
    return summarize(Settings(**{**s, "seeds": tuple(s["seeds"])}), result["runs"])


def run(s: Settings = Settings(), workdir: Path | None = None) -> dict:
    import tempfile

    order = []
    for i, seed in enumerate(s.seeds):
        order += [("sync", seed), ("async", seed)] if i % 2 == 0 else [("async", seed), ("sync", seed)]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="distflow-async-bench-") as tmp:
        work = Path(workdir or tmp)
        for mode, seed in order:
            print(f"[async] {mode} seed {seed} ...", flush=True)
            result = run_one(s, mode, seed, work)
            result["seed"] = seed
            runs[mode].append(result)
            print(f"[async] {mode} seed {seed}: {result['wall_seconds']:.0f} s, eval {result['eval']}", flush=True)
    for mode in runs:
        runs[mode].sort(key=lambda r: r["seed"])
    return {"settings": asdict(s), "order": order, "runs": runs, "summary": summarize(s, runs)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run(Settings(steps=args.steps))
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        args.out.write_text(text)
    print(json.dumps(result["summary"], indent=1, default=float))
