"""Whole jobs through ``distflow run``'s local launcher on the check's device: GRPO, DAPO, PPO, resume.

Every job trains a random model written offline (tests/bench/gpu_models.py) on
the built-in ``arithmetic`` prompts with a reward that varies with the text
(tests/dist/toy_rewards.py), so a random model still gets non-zero advantages
and DAPO's dynamic sampling has groups to keep and to drop. A job passes when
it records every step with a finite policy loss and grad norm; the resume
check passes when a job resumed from the step-1 checkpoint ends with the same
model and optimizer state, bit for bit, as the uninterrupted job.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from tests.bench import gpu_models

REWARDS = Path(__file__).resolve().parents[1] / "dist" / "toy_rewards.py"
STAGE_PREFIX = "timing_s/"


class MemorySampler:
    """Peak memory in use while a job lasts, sampled every 50 ms: on CUDA the driver's used
    bytes per device (every process on it: the job's workers), on CPU the host's
    (MemTotal - MemAvailable, so other load on the host counts too)."""

    def __init__(self, device: torch.device) -> None:
        import threading

        self.device, self.peak, self._stop = device, {}, threading.Event()
        self.baseline = self._used()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {f"cuda:{i}": (lambda free, total: total - free)(*torch.cuda.mem_get_info(i))
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


def job_spec(model_dir: Path, device: torch.device, work: Path, workflow: str, total_steps: int,
             response_len: int, **sections):
    """A one-node job with one worker per GPU (one on CPU), 4 prompts x 4 samples per worker."""
    from tests.dist._jobs import merged

    from distflow.spec import parse_spec

    workers = torch.cuda.device_count() if device.type == "cuda" else 1
    reward = "odd_length" if workflow == "dapo" else "distinct_chars"
    doc = {
        "model": {"path": str(model_dir), "mixedPrecision": "bfloat16" if device.type == "cuda" else "none"},
        "data": {"train": {"path": "arithmetic", "size": 256}, "trainBatchSize": 4 * workers,
                 "maxPromptLength": 64, "maxResponseLength": response_len, "rewardFn": f"{REWARDS}:{reward}"},
        "rollout": {"n": 4, "temperature": 1.0, "engine": "hf"},  # vLLM is not on the GPU machine
        "workflow": {"name": workflow},
        "algorithm": {"useKlLoss": workflow == "grpo"},
        "actor": {"lr": 1e-5, "microBatchSize": 8},
        "critic": {"lr": 1e-5, "microBatchSize": 8},
        "cluster": {"numNodes": 1, "procsPerNode": workers, "device": device.type},
        "trainer": {"totalSteps": total_steps, "seed": 0, "logDir": str(work / "logs")},
        "checkpoint": {"dir": str(work / "ckpt")},
    }
    return parse_spec(merged(doc, sections))


def run_job(spec, resume: bool = False) -> list[dict]:
    """The job's metrics.jsonl records after ``launch_local`` (raises what a worker raised)."""
    from distflow.launcher import launch_local
    from distflow.metrics import read_jsonl

    launch_local(spec, "gpu-check", resume=resume, progress=False)
    return read_jsonl(Path(spec.trainer.log_dir) / "metrics.jsonl")


def judged(records: list[dict], total_steps: int) -> dict:
    """Pass: ``total_steps`` records, each with a finite ``actor/pg_loss`` and ``actor/grad_norm``;
    with tokens/s, and step time by stage per step."""
    finite = all(math.isfinite(r.get(k, math.nan)) for r in records for k in ("actor/pg_loss", "actor/grad_norm"))
    ok = len(records) == total_steps and finite
    steps = [{"step_seconds": r.get("timing_s/step"), "tokens": r.get("perf/total_num_tokens"),
              "tokens_per_s_per_worker": r.get("perf/throughput"), "pg_loss": r.get("actor/pg_loss"),
              "grad_norm": r.get("actor/grad_norm"), "allgather_bytes": r.get("perf/allgather_bytes"),
              "stage_seconds": {k.removeprefix(STAGE_PREFIX): v for k, v in r.items()
                                if k.startswith(STAGE_PREFIX) and k != "timing_s/step"}}
             for r in records]
    tokens = sum(s["tokens"] or 0 for s in steps)
    seconds = sum(s["step_seconds"] or 0 for s in steps)
    return {"status": "pass" if ok else "fail", "checks": {"every_step_recorded": len(records) == total_steps,
                                                          "losses_finite": finite},
            "steps": steps, "tokens_per_s": tokens / seconds if seconds else None}


def job_check(device: torch.device, size: str, workflow: str, total_steps: int, work: Path) -> dict:
    """``total_steps`` of ``workflow`` on a random ``size`` model; ``judged`` plus peak device memory."""
    model_dir = gpu_models.write_model(gpu_models.QWEN2_SHAPES[size], work / "model", device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    spec = job_spec(model_dir, device, work, workflow, total_steps, 128 if device.type == "cuda" else 8)
    start = time.perf_counter()
    with MemorySampler(device) as memory:
        records = run_job(spec)
    return {**judged(records, total_steps), "size": size, "workflow": workflow,
            "wall_seconds": time.perf_counter() - start, "peak_memory_growth_bytes": memory.growth()}


def resume_check(device: torch.device, work: Path) -> dict:
    """2 GRPO steps saving each step; the step-1 checkpoint copied to a second job's directory,
    which resumes and runs step 2: its final model and optimizer must equal the first job's."""
    from tests.dist._jobs import bit_identical, final_checkpoint

    from distflow.checkpoint import complete_checkpoints

    model_dir = gpu_models.write_model(gpu_models.QWEN2_SHAPES["tiny"], work / "model", device)
    specs = [job_spec(model_dir, device, work / name, "grpo", 2, 8, checkpoint={"saveEverySteps": 1})
             for name in ("full", "resumed")]
    full_records = run_job(specs[0])
    first = complete_checkpoints(specs[0].checkpoint.dir)[0]
    shutil.copytree(first, Path(specs[1].checkpoint.dir) / first.name)
    resumed_records = run_job(specs[1], resume=True)
    losses = {name: [records[-1].get(k) for k in ("actor/pg_loss", "actor/grad_norm")]
              for name, records in (("full", full_records), ("resumed", resumed_records))}
    checks = {"final_state_bit_identical": bit_identical(final_checkpoint(specs[0]), final_checkpoint(specs[1])),
              "resumed_at_step_2": [r.get("training/step") for r in resumed_records] == [2],
              "step_2_loss_and_grad_norm_equal": losses["full"] == losses["resumed"]}
    return {"status": "pass" if all(checks.values()) else "fail", "checks": checks, "resumed_from": first.name,
            "step_2_pg_loss_and_grad_norm": losses}
