"""Run policy under production faults: image pulls of gated pods, Kueue preemption, backoff of
uncounted restarts and refused creates, ranks removed after success, quota, the last failure kept."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from distflow_operator.observed import PodView, format_time, job_view, pod_view
from distflow_operator.policy import Rejection, decide
from distflow_operator.status import compute_status

pytestmark = pytest.mark.unit

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=timezone.utc)


def ago(seconds: float) -> str:
    return format_time(NOW - timedelta(seconds=seconds))


def make_job(status=None, run_policy=None):
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
            "cluster": {"numNodes": 2}}
    if run_policy is not None:
        spec["runPolicy"] = run_policy
    return job_view({"metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": 1},
                     "spec": spec, "status": status or {}})


def pod(rank, attempt=1, phase="Running", **kw):
    return PodView(name=f"grpo-node-{rank}", uid=f"p{rank}-{attempt}", owner_uid="u1", rank=rank,
                   attempt=attempt, phase=phase, scheduled=True, ready=phase == "Running", **kw)


def running(attempt=1, **extra):
    return {"phase": "Running", "attempt": attempt, "restarts": 0, "startTime": ago(3600), **extra}


def step(status, pods, now=NOW, **kwargs):
    """One reconcile pass: decide, then the status the operator would write."""
    job = make_job(status, kwargs.pop("run_policy", None))
    decision = decide(job, pods, now, **kwargs)
    return decision, compute_status(job, pods, decision, now)


# -- 2. image pull errors: the grace runs from when the error is first seen -----------------------

def test_a_pod_created_long_ago_that_starts_failing_its_pull_now_gets_the_whole_grace():
    # Gated by Kueue (or waiting for an autoscaled GPU node) for an hour, then ErrImagePull.
    gated = pod(1, phase="Pending", waiting_reason="ErrImagePull", message="registry timeout",
                created=NOW - timedelta(hours=1))
    first, status = step(running(), [pod(0), gated], run_policy={"podErrorGraceSeconds": 120})
    assert first.terminal is None and first.requeue_after == 120.0
    assert status["podErrors"] == [{"pod": "grpo-node-1", "uid": "p1-1", "reason": "ErrImagePull",
                                    "since": format_time(NOW)}]
    later = NOW + timedelta(seconds=119)
    backoff = replace(gated, waiting_reason="ImagePullBackOff")
    decision, status = step(status, [pod(0), backoff], later, run_policy={"podErrorGraceSeconds": 120})
    assert decision.terminal is None and decision.requeue_after == 1.0
    assert status["podErrors"][0]["since"] == format_time(NOW)  # one error, still counted from first sight
    decision, _ = step(status, [pod(0), backoff], NOW + timedelta(seconds=120),
                       run_policy={"podErrorGraceSeconds": 120})
    assert decision.terminal.reason == "ImagePullFailed"
    assert decision.terminal.message == ("node pod grpo-node-1: ImagePullBackOff; registry timeout "
                                         "(still after runPolicy.podErrorGraceSeconds=120)")


def test_a_pull_error_that_clears_is_forgotten():
    failing = pod(1, phase="Pending", waiting_reason="ErrImagePull", created=NOW - timedelta(hours=1))
    _, status = step(running(), [pod(0), failing])
    _, status = step(status, [pod(0), pod(1)], NOW + timedelta(seconds=30))
    assert "podErrors" not in status


# -- 3. Kueue stops pods with the TerminationTarget condition ----------------------------------

def _kueue_stopped(name, uid, attempt):
    return pod_view({
        "metadata": {"name": name, "uid": uid, "deletionTimestamp": format_time(NOW),
                     "labels": {"distflow.io/node-rank": name[-1], "distflow.io/attempt": str(attempt)},
                     "ownerReferences": [{"uid": "u1", "controller": True}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "TerminationTarget", "status": "True", "reason": "StoppedByKueue",
             "message": "Preempted to accommodate a workload (UID: w2) due to prioritization in the ClusterQueue"}]}})


def test_kueue_preemption_is_a_disruption():
    assert _kueue_stopped("grpo-node-0", "x", 1).disrupted


def test_the_fourth_kueue_preemption_does_not_fail_a_job_with_the_default_budget():
    status = running()
    for preemption in range(1, 5):
        attempt = status["attempt"]
        # backoff has passed: a new attempt runs, then Kueue preempts it
        now = NOW + timedelta(hours=preemption)
        pods = [_kueue_stopped(f"grpo-node-{r}", f"u{r}-{attempt}", attempt) for r in (0, 1)]
        decision, status = step(status, pods, now)
        assert decision.terminal is None, decision.terminal
        assert (status["attempt"], status["restarts"], status["disruptions"]) == (attempt + 1, 0, preemption)
        assert status["reason"] == "NodeDisrupted"


# -- 4. uncounted restarts still back off --------------------------------------------------------

def test_uncounted_restarts_back_off_like_counted_ones():
    evicted = pod(0, attempt=3, phase="Failed", reason="Evicted", disrupted=True)
    status = running(3, restarts=1, disruptions=1)
    decision, status = step(status, [evicted, pod(1, attempt=3)], run_policy={"backoffSeconds": 10})
    # the third gang restart of this job (one counted, one disruption before): 10 * 2**2
    assert decision.restart is not None and decision.requeue_after == 40.0
    assert "in 40s" in decision.restart.message
    waiting = decide(make_job(status, {"backoffSeconds": 10}), [], NOW + timedelta(seconds=39))
    assert waiting.create_ranks == () and waiting.requeue_after == pytest.approx(1.0)
    due = decide(make_job(status, {"backoffSeconds": 10}), [], NOW + timedelta(seconds=40))
    assert due.create_ranks == (0, 1)


# -- 12. a refused create is retried after a growing backoff -------------------------------------

def test_a_refused_create_is_tried_again_only_after_a_growing_backoff():
    refused = Rejection(1, 422, "422 Invalid: spec.volumes[0]: not found", since=NOW, last=NOW)
    soon = decide(make_job(running()), [], NOW + timedelta(seconds=1), rejected=refused)
    assert soon.create_ranks == () and soon.requeue_after == pytest.approx(1.0)
    assert soon.waiting[0] == "PodCreationRejected"
    due = decide(make_job(running()), [], NOW + timedelta(seconds=2), rejected=refused)
    assert due.create_ranks == (0, 1)
    second = replace(refused, tries=2, last=NOW + timedelta(seconds=2))
    assert decide(make_job(running()), [], NOW + timedelta(seconds=5), rejected=second).create_ranks == ()
    assert decide(make_job(running()), [], NOW + timedelta(seconds=6), rejected=second).create_ranks == (0, 1)


# -- 13. a rank that succeeded and was garbage-collected; quota; the last failure ----------------

def test_a_succeeded_rank_removed_by_the_pod_garbage_collector_is_neither_lost_nor_rerun():
    done = pod(0, phase="Succeeded", exit_code=0)
    decision, status = step(running(), [done, pod(1)])
    assert status["succeededRanks"] == [0]
    decision, status = step(status, [pod(1)], lost={"grpo-node-0"})
    assert decision.restart is None and decision.create_ranks == ()
    assert status["phase"] == "Running" and status["restarts"] == 0
    decision, status = step(status, [pod(1, phase="Succeeded", exit_code=0)])
    assert decision.terminal.phase == "Succeeded"


def test_succeeded_ranks_are_forgotten_at_a_gang_restart():
    _, status = step(running(), [pod(0, phase="Succeeded", exit_code=0), pod(1)])
    decision, status = step(status, [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Failed", exit_code=1)])
    assert decision.restart is not None and "succeededRanks" not in status
    decision, _ = step(status, [], NOW + timedelta(seconds=10))
    assert decision.create_ranks == (0, 1)


def test_a_quota_refusal_holds_the_job_past_the_grace_and_backs_off():
    quota = ('pods "grpo-node-0" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=8, '
             'used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8')
    refused = Rejection(9, 403, f"403 Forbidden: {quota}", since=NOW - timedelta(hours=2),
                        last=NOW - timedelta(seconds=60))
    decision, status = step(running(2, restarts=1, phase="Restarting"), [], rejected=refused,
                            run_policy={"podErrorGraceSeconds": 120})
    assert decision.terminal is None and decision.create_ranks == (0, 1)
    assert (status["phase"], status["reason"]) == ("Restarting", "QuotaExceeded")
    assert status["message"].startswith("the namespace's ResourceQuota refuses the node pods (9 tries in 7200s);")
    assert "exceeded quota: gpus" in status["message"]
    # The tenth try waits the longest backoff (60 s), not 2 s * 2**8.
    early = decide(make_job(running(2, restarts=1), {"podErrorGraceSeconds": 120}), [], NOW, rejected=replace(
        refused, tries=10, last=NOW - timedelta(seconds=30)))
    assert early.create_ranks == () and early.requeue_after == pytest.approx(30.0)


def test_a_pod_security_refusal_still_fails_after_the_grace():
    refused = Rejection(5, 403, '403 Forbidden: violates PodSecurity "restricted:latest"',
                        since=NOW - timedelta(seconds=121), last=NOW - timedelta(seconds=60))
    decision = decide(make_job(running(), {"podErrorGraceSeconds": 120}), [], NOW, rejected=refused)
    assert decision.terminal.reason == "PodCreationRejected"


def test_the_last_failure_stays_in_the_status_after_the_restart_removes_its_pod():
    oom = pod(1, phase="Failed", exit_code=137, reason="OOMKilled", message="killed at step 412")
    _, status = step(running(), [pod(0), oom])
    expected = {"attempt": 1, "rank": 1, "pod": "grpo-node-1", "reason": "OOMKilled", "exitCode": 137,
                "message": "killed at step 412", "time": format_time(NOW)}
    assert status["lastFailure"] == expected
    # the failed pod is deleted with the restart; the next attempt runs
    _, status = step(status, [pod(0, attempt=2), pod(1, attempt=2)], NOW + timedelta(seconds=30))
    assert status["phase"] == "Running" and status["lastFailure"] == expected
    lost, status = step(status, [pod(1, attempt=2)], NOW + timedelta(seconds=60), lost={"grpo-node-0"})
    assert status["lastFailure"] == {"attempt": 2, "pod": "grpo-node-0", "reason": "NodeLost",
                                     "message": "node pod grpo-node-0 was deleted while running",
                                     "time": format_time(NOW + timedelta(seconds=60))}
