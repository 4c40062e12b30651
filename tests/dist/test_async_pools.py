"""Asynchronous training on a rollout pool and a trainer pool (``distflow.pools``), end to end.

Real local jobs (gloo, the tiny model, the varied-prompt set of ``_jobs``):

- ``maxStaleness: 0`` on 2 trainer + 2 rollout workers trains bit-identically to
  sync mode on 2 workers (same parameters and optimizer state after 2 steps,
  same record ids per step): the cross-pool edge lays the samples out as sync
  mode's rollout -> train edge does.
- ``maxStaleness: 2``: every trained sample's policy version (``trained_ids.jsonl``)
  lags the trainer by at most 2, and by exactly min(step - 1, 2): the rollout
  pool really runs ahead. With the truncated-IS correction the behaviour
  log-probs equal the trainer's own on the first step (same weights, version 0).
- kill -9 of a rollout worker, and of a trainer worker, mid-run: the re-run
  resumes from the last checkpoint, drops and counts the samples in flight,
  and trains every step's prompts once (record ids equal an uninterrupted run's).
"""

from __future__ import annotations

import json

import pytest

from distflow import sample_ids
from distflow.metrics import read_jsonl
from tests.dist._chaos import run_job as run_launcher
from tests.dist._jobs import bit_identical, run_job, tiny_job_spec, varied_prompts

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]


def pooled(staleness: int, rollout_nodes: int = 1, **extra) -> dict:
    return {"async": {"enable": True, "maxStaleness": staleness, "rolloutPool": {"numNodes": rollout_nodes},
                      **extra}}


def held_out(tmp_path) -> dict:
    """A held-out set of 6 prompts, evaluated at steps 0 and the last (by the trainer pool)."""
    return {"eval": {"path": varied_prompts(tmp_path / "eval.jsonl", n=6)}}


def test_staleness_zero_trains_bit_identically_to_sync_mode(tmp_path):
    sync_state, sync_records = run_job(tiny_job_spec(tmp_path, "sync", data=held_out(tmp_path)), "sync")
    spec = tiny_job_spec(tmp_path, "pooled", **pooled(0, rollout_nodes=2), data=held_out(tmp_path),
                         cluster={"numNodes": 4, "procsPerNode": 1, "device": "cpu"})
    pooled_state, records = run_job(spec, "pooled")
    assert bit_identical(pooled_state, sync_state)
    assert sample_ids.read(tmp_path / "pooled") == sample_ids.read(tmp_path / "sync")
    assert [r["async/staleness_max"] for r in records if "async/staleness_max" in r] == [0.0, 0.0]
    # the 2 trainers evaluate what the 2 sync workers did (per-sample seeds): the same scores
    assert [r["eval/score"] for r in records if "eval/score" in r] == \
        [r["eval/score"] for r in sync_records if "eval/score" in r]


def _lines(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / sample_ids.FILE).read_text().splitlines()]


def test_trained_samples_lag_by_at_most_max_staleness_and_the_rollout_runs_ahead(tmp_path):
    spec = tiny_job_spec(tmp_path, "stale2", **pooled(2), trainer={"totalSteps": 5}, data=held_out(tmp_path))
    _, records = run_job(spec, "stale2")
    records = [r for r in records if "timing_s/step" in r]  # the step-0 evaluation has its own record
    lines = _lines(tmp_path / "stale2")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    for line in lines:
        trainer = line["trainer_version"]
        assert trainer == line["step"] - 1
        assert all(0 <= trainer - v <= 2 for v in line["policy_versions"]), line
        # generated at version max(0, step - 1 - 2): the rollout pool is two steps ahead
        assert set(line["policy_versions"]) == {max(0, line["step"] - 3)}
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 2.0, 2.0, 2.0]
    # the rollout pool's lead (the backlog an autoscaler sees): 2 steps of 4 prompts x 2, until the end
    assert [r["async/in_flight_samples"] for r in records] == [16.0, 16.0, 16.0, 8.0, 0.0]
    # tis: step 1's samples come from version 0, which is also the trainer's: the behaviour
    # log-probs (the replica's) and the trainer's old log-probs agree; later steps are off-policy.
    diffs = [r["rollout/actor_logp_diff/mean"] for r in records]
    assert diffs[0] < 1e-5 and all(d > 1e-5 for d in diffs[1:]), diffs


CHAOS_JOB = {**pooled(1), "trainer": {"totalSteps": 4}, "checkpoint": {"saveEverySteps": 1, "keepLast": 2}}


@pytest.fixture(scope="module")
def reference_ids(tmp_path_factory):
    """Record ids per step of an uninterrupted run of ``CHAOS_JOB``."""
    root = tmp_path_factory.mktemp("reference")
    reference = run_launcher(root, sections=CHAOS_JOB)
    assert reference.returncode == 0, reference.output[-3000:]
    return sample_ids.read(root / "job")


@pytest.mark.chaos
@pytest.mark.parametrize("victim", ["rollout", "trainer"])
def test_a_killed_pool_worker_resumes_and_trains_every_prompt_once(tmp_path, reference_ids, victim):
    job = CHAOS_JOB
    # rank 0 trains, rank 1 generates (the rollout pool is the last node)
    chaos = ("rank=1,event=forward,count=15,target=worker" if victim == "rollout"
             else "rank=0,event=optimizer,count=3,target=worker")
    attempts = [run_launcher(tmp_path / "trial", chaos=chaos, sections=job)]
    assert attempts[0].returncode != 0, "the chaos kill did not happen"
    attempts.append(run_launcher(tmp_path / "trial", sections=job))
    assert attempts[-1].returncode == 0, attempts[-1].output[-3000:]
    output = "".join(a.output for a in attempts)
    assert "resumed from the step-" in output
    assert sample_ids.read(tmp_path / "trial" / "job") == reference_ids
    for line in _lines(tmp_path / "trial" / "job"):
        assert all(0 <= line["trainer_version"] - v <= 1 for v in line["policy_versions"]), line
    records = read_jsonl(tmp_path / "trial" / "job" / "metrics.jsonl")
    assert [r["training/step"] for r in records] == [1, 2, 3, 4]
    assert sum(r.get("async/dropped_in_flight_samples", 0) for r in records) == 8  # one step of 4 x 2 in flight


def test_a_run_raised_past_its_last_checkpoint_drops_no_sample(tmp_path):
    """The run that wrote the step-2 checkpoint ended there, with nothing in flight: raising
    trainer.totalSteps resumes it without dropping (or announcing) any sample."""
    ended = {**pooled(1), "trainer": {"totalSteps": 2}, "checkpoint": {"saveEverySteps": 0}}
    first = run_launcher(tmp_path, sections=ended)
    assert first.returncode == 0, first.output[-3000:]
    more = run_launcher(tmp_path, sections={**ended, "trainer": {"totalSteps": 3}})
    assert more.returncode == 0, more.output[-3000:]
    assert "resumed from the step-2 checkpoint" in more.output
    assert "in flight" not in more.output, more.output[-3000:]
    records = [r for r in read_jsonl(tmp_path / "job" / "metrics.jsonl") if "training/step" in r]
    assert [r["training/step"] for r in records] == [1, 2, 3]
    assert all("async/dropped_in_flight_samples" not in r for r in records)


def test_ppo_trains_actor_and_critic_on_a_trainer_pool_of_two(tmp_path):
    spec = tiny_job_spec(tmp_path, "ppo", **pooled(1), workflow={"name": "ppo"},
                         cluster={"numNodes": 3, "procsPerNode": 1, "device": "cpu"})
    _, records = run_job(spec, "ppo")
    assert [r["training/step"] for r in records] == [1, 2]
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0]
    assert all(r["critic/vf_loss"] > 0 for r in records)
    lines = _lines(tmp_path / "ppo")
    assert [len(line["ids"]) for line in lines] == [8, 8]  # 4 prompts x 2 samples, from the one rollout worker
