"""The quickstart with ``rollout.engine: hf`` vs ``vllm``, side by side in one run.

Each engine runs the shortened quickstart (examples/quickstart.yaml: SmolLM2-135M, GRPO, 2
CPU workers; no eval, no checkpoints) as a subprocess, alternating engine order each round.
Per engine, over the steps after the first (start-up and first-call costs excluded): median
step time, rollout tokens/s (generated tokens of all ranks / the rollout stage's time), and
weight-sync seconds per step (hf: the all-gather of the shared actor weights for generate;
vllm: the bucketed all-gather + ``load_weights`` into the engine after each update).

Needs vLLM, so it runs in .ci/setup-vllm's venv:

    $(bash .ci/setup-vllm | tail -1)/bin/python -m tests.bench.vllm_rollout --steps 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.bench._common import median
from tests.vllm._quickstart import run_quickstart

ENGINES = ("hf", "vllm")


def step_figures(rows: list[dict], samples_per_step: int) -> dict:
    """Medians over the steps after the first: step s, rollout tokens/s, weight-sync s per step."""
    steps = [r for r in rows if r.get("training/step", 0) >= 2]
    return {
        "step_s": median([r["timing_s/step"] for r in steps]),
        "rollout_s": median([r["timing_s/rollout"] for r in steps]),
        "rollout_tokens_per_s": median([r["response_length/mean"] * samples_per_step / r["timing_s/rollout"]
                                        for r in steps]),
        "weight_sync_s": median([r.get("timing_s/weight_sync", 0.0) for r in steps]),
        "weight_sync_mib": median([r.get("perf/weight_sync_bytes", 0.0) / 2**20 for r in steps]),
    }


def run(steps: int = 4, rounds: int = 1) -> dict:
    from distflow.spec import load_job_spec

    spec = load_job_spec(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    samples = spec.data.train_batch_size * spec.rollout.n
    results: dict[str, list[dict]] = {e: [] for e in ENGINES}
    with tempfile.TemporaryDirectory(prefix="distflow-bench-vllm-") as tmp:
        for k in range(rounds):
            for engine in ENGINES if k % 2 == 0 else ENGINES[::-1]:
                start = time.perf_counter()
                rows = run_quickstart(Path(tmp) / f"{engine}-{k}", [
                    f"rollout.engine={engine}", f"trainer.totalSteps={steps}", "data.eval=null"])
                figures = step_figures(rows, samples)
                figures["wall_s"] = time.perf_counter() - start
                results[engine].append(figures)
    summary = {e: {key: median([r[key] for r in runs]) for key in runs[0]} for e, runs in results.items()}
    return {"steps": steps, "rounds": rounds, "samples_per_step": samples, "summary": summary}


def print_table(out: dict) -> None:
    s = out["summary"]
    print(f"quickstart, {out['steps']} steps x {out['rounds']} round(s), medians over steps 2..{out['steps']}")
    print(f"{'':24}{'hf':>12}{'vllm':>12}{'vllm/hf':>10}")
    for key in ("step_s", "rollout_s", "rollout_tokens_per_s", "weight_sync_s", "weight_sync_mib", "wall_s"):
        hf, vl = s["hf"][key], s["vllm"][key]
        ratio = f"{vl / hf:10.2f}" if hf else f"{'-':>10}"
        print(f"{key:24}{hf:12.3f}{vl:12.3f}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    out = run(args.steps, args.rounds)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
