"""Run policy decisions: gang restart with backoff, fail fast, deadline, suspend, TTL, terminal jobs."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from distflow_operator.observed import PodView, format_time, job_view, pod_view
from distflow_operator.policy import Rejection, decide, restart_backoff, run_state

pytestmark = pytest.mark.unit

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=timezone.utc)


def ago(seconds: float) -> str:
    return format_time(NOW - timedelta(seconds=seconds))


def make_job(status=None, nodes=2, run_policy=None, spec=None, deleting=False):
    body = {
        "metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": 1,
                     "creationTimestamp": ago(600)},
        "spec": spec if spec is not None else {
            "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
            "cluster": {"numNodes": nodes}, "runPolicy": run_policy or {"maxRestarts": 2, "backoffSeconds": 10}},
        "status": status or {},
    }
    if deleting:
        body["metadata"]["deletionTimestamp"] = ago(1)
    return job_view(body)


def pod(rank, attempt=1, phase="Running", **kw):
    return PodView(name=f"grpo-node-{rank}", uid=f"p{rank}-{attempt}", owner_uid="u1", rank=rank,
                   attempt=attempt, phase=phase, scheduled=True, ready=phase == "Running", **kw)


def running(attempt=1, status_extra=None):
    status = {"phase": "Running", "attempt": attempt, "restarts": attempt - 1, "startTime": ago(300)}
    status.update(status_extra or {})
    return status


def test_new_job_creates_every_rank_and_starts_the_clock():
    decision = decide(make_job(), [], NOW)
    assert decision.create_ranks == (0, 1)
    assert decision.state.attempt == 1 and decision.state.start_time == NOW
    assert decision.delete_pods == () and decision.terminal is None


def test_only_missing_ranks_are_created():
    assert decide(make_job(running()), [pod(1)], NOW).create_ranks == (0,)


def test_healthy_gang_needs_nothing():
    decision = decide(make_job(running()), [pod(0), pod(1)], NOW)
    assert (decision.create_ranks, decision.delete_pods, decision.restart) == ((), (), None)


def test_failed_node_restarts_the_whole_gang_as_the_next_attempt():
    failed = pod(1, phase="Failed", exit_code=1, reason="Error")
    decision = decide(make_job(running()), [pod(0), failed], NOW)
    assert decision.state.attempt == 2 and decision.state.restarts == 1
    assert decision.state.last_restart_time == NOW
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1"}
    assert decision.create_ranks == ()  # old pods must be gone first
    assert decision.restart.reason == "NodeFailed"
    assert decision.restart.message == ("node pod grpo-node-1 failed (Error, exit code 1); restarting all 2 "
                                        "nodes as attempt 2 (restart 1 of 2) in 10s")
    assert decision.requeue_after == 10


def test_backoff_doubles_per_restart_and_is_capped():
    assert [restart_backoff(10, r) for r in (0, 1, 2, 3)] == [0, 10, 20, 40]
    assert restart_backoff(3000, 5) == 3600


def test_old_attempt_pods_are_deleted_before_anything_is_created():
    status = running(2, {"phase": "Restarting", "lastRestartTime": ago(100)})
    old = [pod(0, attempt=1), pod(1, attempt=1, phase="Failed", exit_code=1)]
    decision = decide(make_job(status), old, NOW)
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1"}
    assert decision.create_ranks == () and decision.restart is None


def test_terminating_old_pods_are_waited_for_not_deleted_again():
    status = running(2, {"phase": "Restarting", "lastRestartTime": ago(100)})
    decision = decide(make_job(status), [pod(0, attempt=1, deleting=True)], NOW)
    assert decision.delete_pods == () and decision.create_ranks == ()


def test_new_attempt_waits_out_the_backoff_then_creates_all_ranks():
    waiting = decide(make_job(running(2, {"phase": "Restarting", "lastRestartTime": ago(4)})), [], NOW)
    assert waiting.create_ranks == () and waiting.requeue_after == pytest.approx(6)
    done = decide(make_job(running(2, {"phase": "Restarting", "lastRestartTime": ago(11)})), [], NOW)
    assert done.create_ranks == (0, 1) and done.state.attempt == 2


def test_exceeding_max_restarts_fails_the_job_and_frees_its_nodes():
    status = running(3)  # restarts = 2 = maxRestarts
    failed = pod(0, attempt=3, phase="Failed", exit_code=137, reason="OOMKilled")
    decision = decide(make_job(status), [failed, pod(1, attempt=3)], NOW)
    assert decision.terminal.phase == "Failed" and decision.terminal.reason == "MaxRestartsExceeded"
    assert decision.terminal.message == ("node pod grpo-node-0 failed (OOMKilled, exit code 137); "
                                         "2 restarts used, runPolicy.maxRestarts=2")
    assert [p.name for p in decision.delete_pods] == ["grpo-node-1"]  # the failed pod keeps its logs
    assert decision.state.attempt == 3 and decision.state.completion_time == NOW


def test_max_restarts_zero_fails_on_first_failure():
    job = make_job(running(), run_policy={"maxRestarts": 0})
    decision = decide(job, [pod(0, phase="Failed", exit_code=1), pod(1)], NOW)
    assert decision.terminal.reason == "MaxRestartsExceeded"


def test_invalid_config_exit_code_fails_fast_without_restart():
    failed = pod(0, phase="Failed", exit_code=2, message="spec.data.train.path: no such file")
    decision = decide(make_job(running()), [failed, pod(1)], NOW)
    assert decision.terminal.reason == "InvalidConfig" and decision.state.restarts == 0
    assert "spec.data.train.path: no such file" in decision.terminal.message


def test_invalid_image_name_fails_fast():
    stuck = pod(1, phase="Pending", waiting_reason="InvalidImageName", message='"x:" is not valid')
    decision = decide(make_job(running()), [pod(0), stuck], NOW)
    assert decision.terminal.reason == "ImagePullFailed"
    assert decision.terminal.message == 'node pod grpo-node-1: InvalidImageName; "x:" is not valid'
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1"}


@pytest.mark.parametrize("waiting, reason", [("ImagePullBackOff", "ImagePullFailed"),
                                             ("ErrImagePull", "ImagePullFailed"),
                                             ("CreateContainerConfigError", "InvalidPodConfig")])
def test_transient_pod_errors_fail_the_job_only_after_the_grace_period(waiting, reason):
    policy = {"podErrorGraceSeconds": 120}

    def first_seen(seconds):  # the grace runs from when the operator first saw the error
        return running(status_extra={"podErrors": [
            {"pod": "grpo-node-1", "uid": "p1-1", "reason": waiting, "since": ago(seconds)}]})
    failing = pod(1, phase="Pending", waiting_reason=waiting, created=NOW - timedelta(hours=1))
    decision = decide(make_job(first_seen(30), run_policy=policy), [pod(0), failing], NOW)
    assert decision.terminal is None and decision.requeue_after == 90.0
    decision = decide(make_job(first_seen(120), run_policy=policy), [pod(0), failing], NOW)
    assert decision.terminal.reason == reason and "podErrorGraceSeconds=120" in decision.terminal.message


def test_disruptions_and_ignored_exit_codes_restart_without_using_up_max_restarts():
    policy = {"maxRestarts": 0, "exitCodeRules": [{"exitCodes": [42], "action": "Ignore"},
                                                  {"exitCodes": [3, 2], "action": "FailJob"}]}
    evicted = pod(0, phase="Failed", reason="Evicted", message="node low on memory", disrupted=True)
    for failed in (evicted, pod(0, phase="Failed", exit_code=42), pod(0, deleting=True, disrupted=True)):
        decision = decide(make_job(running(), run_policy=policy), [failed, pod(1)], NOW)
        assert decision.terminal is None and decision.restart is not None, failed
        assert (decision.state.attempt, decision.state.restarts, decision.state.disruptions) == (2, 0, 1)
        assert "not counted in maxRestarts" in decision.restart.message
    counted = decide(make_job(running(), run_policy=policy), [pod(0, phase="Failed", exit_code=1), pod(1)], NOW)
    assert counted.terminal.reason == "MaxRestartsExceeded"
    fatal = decide(make_job(running(), run_policy=policy), [pod(0, phase="Failed", exit_code=3), pod(1)], NOW)
    assert fatal.terminal.reason == "FailJobExitCode"


def test_pods_stuck_terminating_are_force_deleted_after_the_timeout():
    status = {**running(2), "phase": "Restarting", "lastRestartTime": ago(200)}
    policy = {"terminatingTimeoutSeconds": 60, "backoffSeconds": 0}
    fresh = pod(0, attempt=1, deleting=True, deletion_time=NOW - timedelta(seconds=20))
    decision = decide(make_job(status, run_policy=policy), [fresh], NOW)
    assert decision.force_delete_pods == () and decision.requeue_after == 40.0
    assert decision.waiting[0] == "WaitingForTermination" and "grpo-node-0" in decision.waiting[1]
    stuck = replace(fresh, deletion_time=NOW - timedelta(seconds=60))
    assert decide(make_job(status, run_policy=policy), [stuck], NOW).force_delete_pods == (stuck,)


def test_pods_refused_as_invalid_fail_the_job_on_the_third_try():
    refused = Rejection(1, 422, "422 Invalid: spec.volumes[0]: not found", since=NOW - timedelta(seconds=2),
                        last=NOW - timedelta(seconds=2))
    decision = decide(make_job(running()), [], NOW, rejected=refused)
    assert decision.waiting[0] == "PodCreationRejected" and decision.create_ranks == (0, 1)
    assert "1 of 3 tries" in decision.waiting[1] and "spec.volumes[0]" in decision.waiting[1]
    failed = decide(make_job(running()), [], NOW, rejected=replace(refused, tries=3))
    assert failed.terminal.reason == "PodCreationRejected" and "spec.volumes[0]" in failed.terminal.message


def test_pods_forbidden_are_retried_for_the_grace_period_then_fail_the_job():
    # A 403 may clear by itself (a namespace's Pod Security level relaxed, discovery catching up with a new
    # CRD): tries do not count, time does. A quota refusal never fails the job (test_policy_faults.py).
    job = make_job(running(), run_policy={"podErrorGraceSeconds": 30})
    refused = Rejection(40, 403, "403 Forbidden: violates PodSecurity", since=NOW - timedelta(seconds=20),
                        last=NOW - timedelta(seconds=60))
    decision = decide(job, [], NOW, rejected=refused)
    assert decision.terminal is None and decision.create_ranks == (0, 1)
    assert decision.waiting[0] == "PodCreationRejected" and "40 tries in 20s" in decision.waiting[1]
    assert "podErrorGraceSeconds=30" in decision.waiting[1] and decision.requeue_after == 10.0
    failed = decide(job, [], NOW, rejected=replace(refused, since=NOW - timedelta(seconds=30)))
    assert failed.terminal.reason == "PodCreationRejected" and "PodSecurity" in failed.terminal.message


def test_eviction_and_lost_pods_restart_the_gang():
    evicted = pod(0, phase="Failed", reason="Evicted", message="node low on memory")
    assert decide(make_job(running()), [evicted, pod(1)], NOW).restart.reason == "NodeFailed"
    deleted = pod(0, deleting=True)
    assert decide(make_job(running()), [deleted, pod(1)], NOW).restart.reason == "NodeLost"
    vanished = decide(make_job(running()), [pod(1)], NOW, lost={"grpo-node-0"})
    assert vanished.restart.reason == "NodeLost" and vanished.state.attempt == 2


def test_all_nodes_exiting_zero_succeeds_and_partial_success_waits():
    done = [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Succeeded", exit_code=0)]
    decision = decide(make_job(running()), done, NOW)
    assert decision.terminal.phase == "Succeeded" and decision.terminal.reason == "Completed"
    assert decision.delete_pods == () and decision.state.completion_time == NOW
    half = decide(make_job(running()), [done[0], pod(1)], NOW)
    assert half.terminal is None and half.create_ranks == ()


def test_a_finished_job_never_gets_children_again():
    status = {"phase": "Failed", "reason": "MaxRestartsExceeded", "message": "m", "attempt": 3,
              "completionTime": ago(5)}
    decision = decide(make_job(status), [pod(0, attempt=3, phase="Failed")], NOW)
    assert decision.create_ranks == () and decision.delete_pods == ()
    assert (decision.terminal.phase, decision.terminal.reason) == ("Failed", "MaxRestartsExceeded")
    succeeded = decide(make_job({"phase": "Succeeded", "completionTime": ago(5)}), [], NOW)
    assert succeeded.create_ranks == () and succeeded.terminal.phase == "Succeeded"


def test_ttl_after_finished_deletes_the_job_when_due():
    policy = {"ttlSecondsAfterFinished": 60}
    early = decide(make_job({"phase": "Succeeded", "completionTime": ago(20)}, run_policy=policy), [], NOW)
    assert not early.delete_job and early.requeue_after == pytest.approx(40)
    due = decide(make_job({"phase": "Succeeded", "completionTime": ago(61)}, run_policy=policy), [], NOW)
    assert due.delete_job


def test_deadline_fails_a_running_job_and_is_requeued_before():
    policy = {"activeDeadlineSeconds": 600}
    before = decide(make_job(running(), run_policy=policy), [pod(0), pod(1)], NOW)
    assert before.terminal is None and before.requeue_after == pytest.approx(300)
    status = running(1, {"startTime": ago(601)})
    after = decide(make_job(status, run_policy=policy), [pod(0), pod(1)], NOW)
    assert after.terminal.reason == "DeadlineExceeded" and len(after.delete_pods) == 2
    assert after.terminal.message == "running for 601s, past runPolicy.activeDeadlineSeconds=600"


def test_suspend_deletes_pods_and_resume_starts_a_new_attempt_without_a_restart():
    policy = {"suspend": True}
    suspended = decide(make_job(running(), run_policy=policy), [pod(0), pod(1)], NOW)
    assert suspended.suspended and len(suspended.delete_pods) == 2 and suspended.create_ranks == ()
    resumed = decide(make_job({"phase": "Suspended", "attempt": 1, "startTime": ago(300)}), [], NOW)
    assert resumed.state.attempt == 2 and resumed.state.restarts == 0
    assert resumed.create_ranks == (0, 1) and resumed.state.start_time == NOW


def test_pods_deleted_by_the_suspension_are_not_lost_nodes_on_resume():
    status = {"phase": "Suspended", "attempt": 1, "startTime": ago(300)}
    decision = decide(make_job(status), [], NOW, lost={"grpo-node-0", "grpo-node-1"})
    assert decision.restart is None and decision.create_ranks == (0, 1) and decision.state.attempt == 2


def test_resume_waits_for_pods_still_terminating_from_the_suspension():
    status = {"phase": "Suspended", "attempt": 1, "startTime": ago(300)}
    decision = decide(make_job(status), [pod(0, deleting=True)], NOW)
    assert decision.restart is None and decision.create_ranks == () and decision.state.attempt == 2


def test_job_created_suspended_starts_at_attempt_one_when_resumed():
    assert decide(make_job(run_policy={"suspend": True}), [], NOW).suspended
    resumed = decide(make_job({"phase": "Suspended", "attempt": 1}), [], NOW)
    assert resumed.state.attempt == 1 and resumed.create_ranks == (0, 1)


def test_invalid_spec_fails_without_children():
    decision = decide(make_job(spec={"model": {"path": "tiny"}}), [], NOW)
    assert decision.terminal.reason == "InvalidSpec" and decision.create_ranks == ()
    assert decision.terminal.message == "spec.data: required field is missing; add it"


def test_pods_of_a_newer_attempt_win_over_a_lost_status_write():
    state = run_state({"attempt": 2, "restarts": 1}, [pod(0, attempt=3)])
    assert state.attempt == 3 and state.restarts == 1


def test_failures_of_old_attempts_are_ignored():
    status = running(2)
    old = pod(1, attempt=1, phase="Failed", exit_code=1, deleting=True)
    decision = decide(make_job(status), [pod(0, attempt=2), pod(1, attempt=2), old], NOW)
    assert decision.restart is None and decision.terminal is None


def test_deleting_job_is_left_to_the_garbage_collector():
    decision = decide(make_job(running(), deleting=True), [pod(0, phase="Failed")], NOW)
    assert (decision.create_ranks, decision.delete_pods, decision.restart) == ((), (), None)


def test_pod_view_reads_rank_attempt_and_exit_from_a_pod_object():
    view = pod_view({
        "metadata": {"name": "grpo-node-1", "uid": "x", "deletionTimestamp": ago(1),
                     "labels": {"distflow.io/node-rank": "1", "distflow.io/attempt": "4"},
                     "ownerReferences": [{"uid": "u1", "controller": True}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "node", "ports": [
            {"name": "metrics", "containerPort": 9400}]}]},
        "status": {"phase": "Failed", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "False"}],
                   "containerStatuses": [{"name": "node", "state": {"terminated": {
                       "exitCode": 2, "reason": "Error", "message": " bad spec \n"}}}]}})
    assert view == PodView(name="grpo-node-1", uid="x", owner_uid="u1", rank=1, attempt=4, phase="Failed",
                           scheduled=True, ready=False, deleting=True, exit_code=2, reason="Error",
                           message="bad spec", pod_ip="10.0.0.7", metrics_port=9400,
                           deletion_time=NOW - timedelta(seconds=1))


def test_started_job_with_unreadable_spec_is_held_not_failed():
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
            "cluster": {"numNodes": 2}, "rollout": {"engine": "an-engine-from-a-newer-crd"}}
    decision = decide(make_job(running(), spec=spec), [pod(0), pod(1)], NOW)
    assert decision.terminal is None and decision.delete_pods == () and decision.create_ranks == ()
    assert decision.held.reason == "UnreadableSpec" and "spec.rollout.engine" in decision.held.message


def test_unknown_fields_from_a_newer_crd_are_ignored_and_named():
    job = make_job(running(), run_policy={"maxRestarts": 2, "fieldFromANewerCrd": 7})
    assert job.spec is not None and job.spec.run_policy.max_restarts == 2
    assert job.unknown_fields == ("spec.runPolicy.fieldFromANewerCrd",)
    assert decide(job, [pod(0), pod(1)], NOW).held is None
