"""End to end: GRPO step throughput of distflow against TRL's ``GRPOTrainer``.

Both train SmolLM2-135M-Instruct (the same converted local directory, fp32)
on the same GSM8K train prompts in file order (no shuffle, so step k sees
the same prompts in both), with the same group size, prompts per step,
response length, sampling (temperature 1, top-p 1, no top-k), learning rate,
one optimizer step per batch, no KL term / reference model, no gradient
checkpointing, and the same CPU threads in total:

- distflow: ``distflow run`` with 2 local workers x 1 thread (gloo, FSDP2),
  with its defaults ``rollout.sharePrefill`` (each prompt prefilled once for
  its group, the KV cache repeated for the n samples) and
  ``actor.sharePromptPrefix`` (log-prob and training forwards run each
  prompt once per micro-batch: one row [prompt, r_1..r_k] with a 4-D mask,
  Prefix Grouper, arXiv 2506.05433), and with ``actor.reshardAfterForward:
  false`` (the weights the rollout all-gathers serve the update: one
  all-gather per step instead of three), recorded in the settings;
- TRL: one process x 2 threads (its documented single-process CPU setup),
  which processes each prompt once per sample (n times per group).

Both compute the same losses on the same tokens (up to float rounding);
distflow skips recomputing the shared prompt. Throughput counts every
sample's prompt + response tokens on both sides, shared or not.

Each is started in its own process; runs alternate (distflow, TRL, TRL,
distflow, ...). Throughput is verl's numerator, prompt + response tokens of
the step, over the step's wall time, per machine: both use the whole 2-core
machine, so dividing by "accelerators" would only count distflow's worker
processes against it. The first step of every run (warm-up: lazy
initialisation, allocator growth) is dropped; the rest are pooled per
framework and the median step is reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tests.bench._common import bench_env, median, run_distflow_job
from tests.bench.balancer import gsm8k_dir


@dataclass(frozen=True)
class Settings:
    prompts_per_step: int = 2
    group_size: int = 4
    max_response_length: int = 48
    max_prompt_length: int = 512
    micro_batch_size: int = 8
    steps: int = 3
    threads: int = 2
    workers: int = 2
    lr: float = 1e-6
    seed: int = 0
    share_prefill: bool = True
    """distflow only: ``rollout.sharePrefill``."""
    share_prompt_prefix: bool = True
    """distflow only: ``actor.sharePromptPrefix``."""
    reshard_after_forward: bool = False
    """distflow only: ``actor.reshardAfterForward``. False (ZeRO-2 style) keeps the weights the
    rollout all-gathered through the update, as TRL's single process holds the whole model."""


def distflow_spec(s: Settings, log_dir: str) -> dict:
    """The local run config (a JobSpec mapping) of the distflow side."""
    return {
        "model": {"path": "smollm2", "dtype": "float32", "mixedPrecision": "none"},
        "data": {"train": {"path": str(gsm8k_dir() / "train.jsonl")}, "trainBatchSize": s.prompts_per_step,
                 "maxPromptLength": s.max_prompt_length, "maxResponseLength": s.max_response_length,
                 "shuffle": False, "rewardFn": "gsm8k"},
        "rollout": {"n": s.group_size, "temperature": 1.0, "topP": 1.0, "topK": 0,
                    "microBatchSize": s.prompts_per_step * s.group_size, "sharePrefill": s.share_prefill},
        "algorithm": {"advantageEstimator": "grpo", "useKlLoss": False, "lossAggMode": "token-mean"},
        "actor": {"lr": s.lr, "microBatchSize": s.micro_batch_size, "sharePromptPrefix": s.share_prompt_prefix,
                  "reshardAfterForward": s.reshard_after_forward},
        "cluster": {"numNodes": s.workers, "procsPerNode": 1, "device": "cpu"},
        "trainer": {"totalSteps": s.steps, "seed": s.seed, "logDir": log_dir,
                    "numThreads": max(1, s.threads // s.workers)},
    }


def run_distflow(s: Settings, workdir: Path, tag: str, timeout_s: float) -> dict:
    """One ``distflow run``; per-step wall seconds and tokens from its metrics.jsonl."""
    import yaml

    log_dir = workdir / f"distflow-{tag}"
    config = workdir / f"distflow-{tag}.yaml"
    config.write_text(yaml.safe_dump(distflow_spec(s, str(log_dir))))
    records, wall = run_distflow_job(config, (), log_dir, f"bench-{tag}", workdir, timeout_s)
    steps = [r for r in records if "timing_s/step" in r]
    stages = sorted({k for r in steps for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {"step_seconds": [r["timing_s/step"] for r in steps],
            "step_tokens": [r["perf/total_num_tokens"] for r in steps],
            "stage_seconds": {k.removeprefix("timing_s/"): [r.get(k, 0.0) for r in steps] for k in stages},
            "response_length": [r.get("response_length/mean", 0.0) for r in steps],
            "wall_seconds": wall}


def run_trl(s: Settings, workdir: Path, tag: str, timeout_s: float) -> dict:
    out = workdir / f"trl-{tag}.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tests.bench.e2e_trl", "--trl-child", str(out),
                           "--settings", json.dumps(asdict(s))],
                          env=bench_env(), cwd=workdir, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {**json.loads(out.read_text()), "wall_seconds": time.perf_counter() - start}


def trl_child(s: Settings, out_path: str) -> None:
    """Runs in its own process: TRL GRPO for ``s.steps`` optimizer steps, timed by a callback."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from distflow.data.sources import open_source
    from distflow.models import load_causal_lm, load_tokenizer, resolve_model
    from distflow.rewards import gsm8k_reward
    from distflow.models import model_cache_dir

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    model_dir = resolve_model("smollm2", model_cache_dir())
    count = s.prompts_per_step * (s.steps + 1)
    records = open_source(str(gsm8k_dir() / "train.jsonl"), size=count).read(range(count))
    dataset = Dataset.from_list([{"prompt": list(r.messages), "ground_truth": r.ground_truth}
                                 for r in records])

    def reward(completions, ground_truth, **_):
        return [gsm8k_reward(c[-1]["content"], g) for c, g in zip(completions, ground_truth)]

    samples = s.prompts_per_step * s.group_size
    accumulation = max(1, samples // s.micro_batch_size)
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"), max_steps=s.steps, learning_rate=s.lr,
        per_device_train_batch_size=min(s.micro_batch_size, samples), gradient_accumulation_steps=accumulation,
        num_generations=s.group_size, max_completion_length=s.max_response_length,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo",
        gradient_checkpointing=False, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
        lr_scheduler_type="constant", warmup_steps=0,
        report_to="none", shuffle_dataset=False, seed=s.seed, disable_tqdm=True,
        dataloader_num_workers=0)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    timer = type("StepTimer", (StepTimes, TrainerCallback), {})()  # TrainerCallback: no-op other hooks
    trainer = GRPOTrainer(model=load_causal_lm(model_dir, "float32"), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    timer.start = time.perf_counter()
    trainer.train()
    Path(out_path).write_text(json.dumps(timer.result()))


class StepTimes:
    """Wall time between optimizer steps and TRL's cumulative token counter per step."""

    def __init__(self) -> None:
        self.start = 0.0
        self.ends: list[float] = []
        self.tokens: list[float] = []
        self.lengths: list[float] = []

    def on_step_end(self, args, state, control, **_):
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **_):
        if logs and "num_tokens" in logs:
            self.tokens.append(float(logs["num_tokens"]))
            self.lengths.append(float(logs.get("completions/mean_length", 0.0)))

    def result(self) -> dict:
        marks = [self.start] + self.ends
        seconds = [b - a for a, b in zip(marks, marks[1:])]
        cumulative = [0.0] + self.tokens
        return {"step_seconds": seconds, "step_tokens": [b - a for a, b in zip(cumulative, cumulative[1:])],
                "response_length": self.lengths}


def run(settings: Settings = Settings(), rounds: int = 2, timeout_s: float = 1200.0,
        single_worker_check: bool = True) -> dict:
    """Alternate distflow and TRL ``rounds`` times each; pooled per-step medians.

    With ``single_worker_check``, one more distflow run with 1 worker x all
    threads (no FSDP collectives, no second process) separates what the
    data-parallel split costs from what the runtime's single-process path costs.
    A run that fails or times out is recorded with its error and left out;
    the comparison needs at least one finished run of each.

    Raises:
        RuntimeError: a framework has no finished run (its errors attached), or TRL is not installed.
    """
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"the end-to-end benchmark needs {' and '.join(missing)}: "
                           "install the bench extra (pip install -e '.[bench]')")
    runs = {"distflow": [], "trl": []}
    order = ("distflow", "trl")
    with tempfile.TemporaryDirectory(prefix="distflow-bench-e2e-") as tmp:
        for k in range(rounds):
            for name in order if k % 2 == 0 else order[::-1]:
                fn = run_distflow if name == "distflow" else run_trl
                try:
                    runs[name].append(fn(settings, Path(tmp), f"{name}{k}", timeout_s))
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    runs[name].append({"error": f"{type(err).__name__}: {str(err)[-400:]}"})
        if single_worker_check:
            one = replace(settings, workers=1)
            try:
                runs["distflow_1_worker"] = [run_distflow(one, Path(tmp), "single", timeout_s)]
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                runs["distflow_1_worker"] = [{"error": f"{type(err).__name__}: {str(err)[-400:]}"}]
    summary = {name: _summarize([r for r in items if "error" not in r], items) for name, items in runs.items()
               if name != "distflow_1_worker" or "error" not in items[0]}
    speedup = summary["distflow"]["median_tokens_per_s"] / summary["trl"]["median_tokens_per_s"]
    return {"settings": asdict(settings), "rounds": rounds, "runs": runs, "summary": summary,
            "speedup": speedup, "trl_version": _version("trl")}


def _summarize(done: list[dict], items: list[dict]) -> dict:
    if not done:
        raise RuntimeError("no finished run: " + "; ".join(r["error"] for r in items))
    seconds = [x for r in done for x in r["step_seconds"][1:]]
    tokens = [x for r in done for x in r["step_tokens"][1:]]
    stages = {k: median([x for r in done for x in r.get("stage_seconds", {}).get(k, [])[1:]])
              for k in done[0].get("stage_seconds", {})}
    return {"median_step_seconds": median(seconds), "median_step_tokens": median(tokens),
            "median_stage_seconds": stages,
            "median_tokens_per_s": median([t / sec for t, sec in zip(tokens, seconds)]),
            "mean_response_length": median([x for r in done for x in r["response_length"][1:]]),
            "steps_measured": len(seconds), "runs_failed": len(items) - len(done),
            "run_wall_seconds": [r["wall_seconds"] for r in done]}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-child", metavar="OUT_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help="JSON overrides of Settings fields")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = Settings(**json.loads(args.settings))
    if args.trl_child:
        trl_child(settings, args.trl_child)
        return
    out = run(settings, args.rounds)
    print(json.dumps(out["summary"], indent=1))
    print(f"distflow / TRL throughput: {out['speedup']:.2f}x")


if __name__ == "__main__":
    main()
