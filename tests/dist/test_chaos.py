"""Chaos loop: SIGKILL a worker, or the whole launcher, at a drawn moment; re-run; nothing is lost.

Each trial kills one run of a 4-step job (2 workers, a checkpoint every
step) at the n-th event of one kind on one rank (``distflow.chaos``):
during rollout (a forward call), inside an exchange (all_to_all), after an
optimizer step, or in the middle of writing a checkpoint. Then the job is
run again until it finishes. Asserted per trial: the re-run resumes and
finishes; the final parameters and optimizer state are bit-identical to an
uninterrupted run's; for every step, the set (multiset) of record ids
trained on equals the uninterrupted run's (no sample lost, none trained twice).

Default suite: two trials (a worker killed mid-checkpoint, the launcher
killed in an optimizer step). ``DISTFLOW_CHAOS_TRIALS=20`` runs 20 seeded
trials (``DISTFLOW_CHAOS_SEED``, default 0) that cycle through every event
kind and both targets. ``DISTFLOW_CHAOS_BUDGET_S`` stops starting trials once
that many seconds have passed (the trials run are then the first ones drawn).
Either way a summary line with the figures is printed.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter

import pytest

from distflow import sample_ids
from tests.dist._chaos import JOB, Trial, draw_trials, read_tally, run_job
from tests.dist._jobs import bit_identical, final_checkpoint, tiny_job_spec

# Generous: a trial is two launches of a 2-worker job, minutes each on a loaded 2-core machine.
pytestmark = [pytest.mark.dist, pytest.mark.chaos, pytest.mark.timeout(7200)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its final state, trained ids per step and event tally."""
    root = tmp_path_factory.mktemp("reference")
    attempt = run_job(root, tally=root / "tally")
    assert attempt.returncode == 0, attempt.output[-3000:]
    spec = tiny_job_spec(root, "job", **JOB)
    return final_checkpoint(spec), sample_ids.read(spec.trainer.log_dir), read_tally(root / "tally")


def _trials(tally) -> list[Trial]:
    wanted = int(os.environ.get("DISTFLOW_CHAOS_TRIALS", "0"))
    if wanted:
        return draw_trials(wanted, int(os.environ.get("DISTFLOW_CHAOS_SEED", "0")), tally)
    return [Trial("worker", "checkpoint", 0, 4), Trial("launcher", "optimizer", 1, min(3, tally[1]["optimizer"]))]


def _run_trial(trial: Trial, job_dir) -> None:
    trial.attempts.append(run_job(job_dir, chaos=trial.chaos))
    for _ in range(3):  # a re-run is not killed; more than one would mean resume itself failed
        if trial.attempts[-1].returncode == 0:
            return
        trial.attempts.append(run_job(job_dir))


def test_killed_runs_resume_and_lose_nothing(reference, tmp_path):
    ref_state, ref_ids, tally = reference
    trials = _trials(tally)
    budget_s = float(os.environ.get("DISTFLOW_CHAOS_BUDGET_S", "inf"))
    start, results = time.monotonic(), []
    for i, trial in enumerate(trials):
        if time.monotonic() - start > budget_s:
            print(f"chaos: time budget of {budget_s:.0f} s spent after {i} trials", flush=True)
            break
        job_dir = tmp_path / f"trial{i:02d}"
        _run_trial(trial, job_dir)
        spec = tiny_job_spec(job_dir, "job", **JOB)
        finished = trial.attempts[-1].returncode == 0
        identical = finished and bit_identical(final_checkpoint(spec), ref_state)
        ids = sample_ids.read(spec.trainer.log_dir) if finished else {}
        same_steps = sum(ids.get(s) == want for s, want in ref_ids.items())
        resumed = re.findall(r"resumed from the step-(\d+) checkpoint", "".join(a.output for a in trial.attempts))
        skipped = sum(a.output.count("distflow: skipping checkpoint") for a in trial.attempts)
        results.append(dict(trial=trial.chaos, killed=trial.attempts[0].returncode != 0, finished=finished,
                            identical=identical, same_steps=same_steps, resumed=resumed, skipped=skipped,
                            runs=len(trial.attempts)))
        print(f"chaos trial {i} ({time.monotonic() - start:.0f} s): {results[-1]}", flush=True)
    _print_summary(trials, results, len(ref_ids))  # zip: the trials run
    assert results, "no trial ran (DISTFLOW_CHAOS_BUDGET_S too small?)"
    for trial, result in zip(trials, results):
        assert result["killed"], f"{trial.chaos}: the kill did not happen (exit 0)"
        assert result["finished"] and result["runs"] == 2, \
            f"{trial.chaos}: not finished after one re-run:\n{trial.attempts[-1].output[-3000:]}"
        assert result["identical"], f"{trial.chaos}: final state differs from the uninterrupted run"
        assert result["same_steps"] == len(ref_ids), f"{trial.chaos}: trained ids differ: {result}"


def _print_summary(trials: list[Trial], results: list[dict], num_steps: int) -> None:
    survived = sum(r["finished"] for r in results)
    moments = Counter(f"{t.target}@{t.event}" for t, _ in zip(trials, results))
    resumed = Counter(r["resumed"][-1] if r["resumed"] else "0" for r in results)
    print(f"\nchaos summary: {survived}/{len(results)} trials survived ({len(results)} of {len(trials)} drawn run; "
          f"seed {os.environ.get('DISTFLOW_CHAOS_SEED', '0')}) "
          f"(killed {sum(r['killed'] for r in results)}; {dict(sorted(moments.items()))}); "
          f"final parameters+optimizer bit-identical {sum(r['identical'] for r in results)}/{len(results)}; "
          f"trained-id sets equal {sum(r['same_steps'] for r in results)}/{num_steps * len(results)} steps; "
          f"resumed from step {dict(sorted(resumed.items()))}; incomplete checkpoints skipped "
          f"{sum(r['skipped'] for r in results)}", flush=True)
