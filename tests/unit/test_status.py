"""Status computation: phase, conditions, node counts, progress, patches and events."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from distflow_operator.observed import PodView, format_time, job_view
from distflow_operator.policy import decide
from distflow_operator.progress import parse_progress
from distflow_operator.status import (
    CONDITION_TYPES, JobStatus, compute_status, status_patch, transition_events,
)

pytestmark = pytest.mark.unit

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
EARLIER = format_time(NOW - timedelta(minutes=5))


def make_job(status=None, generation=1, run_policy=None):
    return job_view({
        "metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": generation},
        "spec": {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                 "cluster": {"numNodes": 2}, "trainer": {"totalSteps": 20},
                 "runPolicy": run_policy or {"maxRestarts": 2, "backoffSeconds": 10}},
        "status": status or {}})


def pod(rank, attempt=1, phase="Running", ready=None, scheduled=True, **kw):
    return PodView(name=f"grpo-node-{rank}", owner_uid="u1", rank=rank, attempt=attempt, phase=phase,
                   scheduled=scheduled, ready=phase == "Running" if ready is None else ready, **kw)


def status_for(job, pods, scraped=None, now=NOW):
    return compute_status(job, pods, decide(job, pods, now), now, scraped)


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_new_job_is_pending_with_every_condition_false():
    status = status_for(make_job(), [])
    assert (status["phase"], status["reason"], status["message"]) == ("Pending", "NodesPending",
                                                                     "0/2 nodes scheduled")
    assert (status["attempt"], status["restarts"], status["nodes"]) == (1, 0, "0/2")
    assert status["startTime"] == format_time(NOW)
    conds = conditions(status)
    assert list(conds) == list(CONDITION_TYPES)
    assert all(c["status"] == "False" and c["lastTransitionTime"] == format_time(NOW) and
               c["observedGeneration"] == 1 for c in conds.values())


def test_scheduled_but_not_running_is_starting():
    status = status_for(make_job({"attempt": 1, "startTime": EARLIER}),
                        [pod(0), pod(1, phase="Pending", scheduled=True)])
    assert (status["phase"], status["message"]) == ("Starting", "1/2 nodes running")


def test_unscheduled_pod_keeps_the_job_pending():
    status = status_for(make_job({"attempt": 1}), [pod(0), pod(1, phase="Pending", scheduled=False)])
    assert status["phase"] == "Pending" and status["message"] == "1/2 nodes scheduled"


def test_all_nodes_running_and_ready_is_running_and_ready():
    status = status_for(make_job({"phase": "Starting", "attempt": 1, "startTime": EARLIER}), [pod(0), pod(1)])
    assert (status["phase"], status["nodes"], status["readyNodes"], status["desiredNodes"]) == \
        ("Running", "2/2", 2, 2)
    ready = conditions(status)["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("True", "AllNodesReady", "2/2 nodes ready")


def test_running_but_not_ready_counts_ready_nodes_separately():
    status = status_for(make_job({"attempt": 1, "startTime": EARLIER}), [pod(0), pod(1, ready=False)])
    assert status["phase"] == "Running" and status["nodes"] == "1/2"
    assert conditions(status)["Ready"]["status"] == "False"
    assert conditions(status)["Ready"]["message"] == "1/2 nodes ready"


def test_gang_restart_is_restarting_until_the_new_attempt_runs():
    failed = pod(1, phase="Failed", exit_code=1, reason="Error")
    first = status_for(make_job({"phase": "Running", "attempt": 1, "startTime": EARLIER}), [pod(0), failed])
    assert (first["phase"], first["reason"], first["attempt"], first["restarts"]) == \
        ("Restarting", "NodeFailed", 2, 1)
    assert first["lastRestartTime"] == format_time(NOW)
    assert conditions(first)["Restarting"]["status"] == "True"
    assert "restarting all 2 nodes as attempt 2" in conditions(first)["Restarting"]["message"]
    later = NOW + timedelta(seconds=30)
    midway = status_for(make_job(first), [pod(0, attempt=2)], now=later)
    assert midway["phase"] == "Restarting" and midway["message"] == first["message"]
    back = status_for(make_job(midway), [pod(0, attempt=2), pod(1, attempt=2)], now=later)
    assert back["phase"] == "Running" and conditions(back)["Restarting"]["status"] == "False"


def test_failed_job_carries_reason_in_phase_and_failed_condition():
    status = status_for(make_job({"phase": "Running", "attempt": 1, "startTime": EARLIER}),
                        [pod(0, phase="Failed", exit_code=2, message="bad"), pod(1)])
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidConfig")
    failed = conditions(status)["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "InvalidConfig")
    assert status["completionTime"] == format_time(NOW)


def test_succeeded_and_suspended_phases():
    done = [pod(0, phase="Succeeded"), pod(1, phase="Succeeded")]
    succeeded = status_for(make_job({"phase": "Running", "attempt": 1, "startTime": EARLIER}), done)
    assert succeeded["phase"] == "Succeeded" and conditions(succeeded)["Succeeded"]["status"] == "True"
    suspended = status_for(make_job({"phase": "Running", "attempt": 1}, run_policy={"suspend": True}),
                           [pod(0), pod(1)])
    assert suspended["phase"] == "Suspended" and conditions(suspended)["Suspended"]["reason"] == "Suspended"


def test_last_transition_time_moves_only_when_a_condition_flips():
    first = status_for(make_job({"phase": "Starting", "attempt": 1, "startTime": EARLIER}), [pod(0), pod(1)])
    later = NOW + timedelta(minutes=3)
    again = status_for(make_job(first, generation=2), [pod(0), pod(1)], now=later)
    for ctype in CONDITION_TYPES:
        assert conditions(again)[ctype]["lastTransitionTime"] == format_time(NOW), ctype
        assert conditions(again)[ctype]["observedGeneration"] == 2
    flipped = status_for(make_job(again, generation=2), [pod(0), pod(1, ready=False)], now=later)
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == format_time(later)
    assert conditions(flipped)["Failed"]["lastTransitionTime"] == format_time(NOW)


def test_steady_job_recomputes_the_identical_status():
    job = make_job({"phase": "Starting", "attempt": 1, "startTime": EARLIER})
    first = status_for(job, [pod(0), pod(1)])
    assert status_for(make_job(first), [pod(0), pod(1)], now=NOW + timedelta(hours=1)) == first
    assert status_patch(first, first) == {}


def test_progress_merges_scrapes_and_keeps_the_last_one():
    job = make_job({"phase": "Running", "attempt": 1, "startTime": EARLIER})
    status = status_for(job, [pod(0), pod(1)], scraped={"step": 7, "tokensPerSecond": 812.5})
    assert status["progress"] == {"step": 7, "totalSteps": 20, "tokensPerSecond": 812.5}
    kept = status_for(make_job(status), [pod(0), pod(1)], scraped=None)
    assert kept["progress"] == status["progress"]


def test_status_conforms_to_the_crd_status_model():
    status = status_for(make_job(), [pod(0, phase="Pending", scheduled=False)], scraped={"step": 1})
    assert JobStatus.model_validate(status).model_dump(exclude_none=True) == status


def test_status_patch_sets_changes_and_nulls_removed_keys():
    old = {"phase": "Running", "completionTime": "t", "attempt": 1}
    assert status_patch(old, {"phase": "Pending", "attempt": 1}) == {"phase": "Pending", "completionTime": None}


def test_status_patch_nulls_keys_removed_inside_an_object_a_merge_patch_would_keep():
    # A stop-and-restart resize recorded over an in-place one: the merge patch must drop inPlace.
    old = {"phase": "Running", "lastResize": {"from": 2, "to": 3, "attempt": 1, "inPlace": True}}
    new = {"phase": "Running", "lastResize": {"from": 2, "to": 3, "attempt": 2, "stoppedAt": "t"}}
    assert status_patch(old, new) == {"lastResize": {"attempt": 2, "inPlace": None, "stoppedAt": "t"}}
    assert status_patch(old, {"phase": "Running"}) == {"lastResize": None}


def test_transition_events_for_restarts_failures_and_resume():
    running = {"phase": "Running", "restarts": 0}
    restarting = {"phase": "Restarting", "restarts": 1, "reason": "NodeFailed", "message": "m"}
    assert transition_events(running, restarting) == [("Warning", "NodeFailed", "m")]
    failed = {"phase": "Failed", "restarts": 1, "reason": "MaxRestartsExceeded", "message": "x"}
    assert transition_events(restarting, failed) == [("Warning", "MaxRestartsExceeded", "x")]
    assert transition_events({"phase": "Pending"}, {"phase": "Starting", "reason": "NodesStarting"}) == []
    resumed = transition_events({"phase": "Suspended"}, {"phase": "Pending", "reason": "NodesPending"})
    assert resumed == [("Normal", "Resumed", "runPolicy.suspend is false; recreating node pods")]
    assert transition_events({"phase": "Starting"}, {"phase": "Running", "reason": "AllNodesRunning",
                                                     "message": "2/2 nodes running"}) == [
        ("Normal", "AllNodesRunning", "2/2 nodes running")]


def test_progress_is_parsed_from_node_metrics():
    text = ("# TYPE distflow_step gauge\n"
            'distflow_step{job_name="grpo",node="0"} 12.0\n'
            "# TYPE distflow_throughput_tokens_per_second gauge\n"
            'distflow_throughput_tokens_per_second{job_name="grpo",node="0"} 1234.5678\n'
            "# TYPE distflow_checkpoint_step gauge\n"
            "distflow_checkpoint_step 10\n"
            "# TYPE distflow_step_duration_seconds gauge\n"
            "distflow_step_duration_seconds 6.25\n"
            "# TYPE distflow_reward_mean gauge\n"
            "distflow_reward_mean 0.4\n")
    assert parse_progress(text) == {"step": 12, "tokensPerSecond": 1234.568, "lastCheckpointStep": 10,
                                    "stepSeconds": 6.25}
    assert parse_progress("# nothing here\n") == {}


def test_version_skew_condition_names_unknown_fields_and_posts_one_event():
    job = make_job(run_policy={"maxRestarts": 2, "fieldFromANewerCrd": True})
    first = status_for(job, [pod(0), pod(1)])
    skew = conditions(first)["VersionSkew"]
    assert (skew["status"], skew["reason"]) == ("True", "UnknownFields")
    assert "spec.runPolicy.fieldFromANewerCrd" in skew["message"]
    assert ("Warning", "UnknownFields", skew["message"]) in transition_events({}, first)
    again = status_for(make_job(first, run_policy={"maxRestarts": 2, "fieldFromANewerCrd": True}), [pod(0), pod(1)])
    assert not [e for e in transition_events(first, again) if e[1] == "UnknownFields"]
    assert conditions(status_for(make_job(first), [pod(0), pod(1)]))["VersionSkew"]["status"] == "False"


def test_held_job_keeps_its_status_and_only_flips_version_skew():
    running = status_for(make_job(), [pod(0), pod(1)])
    unreadable = job_view({"metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": 2},
                           "spec": {"model": {"path": "tiny"}, "cluster": {"numNodes": "many"}},
                           "status": running})
    held = status_for(unreadable, [pod(0), pod(1)])
    assert {k: v for k, v in held.items() if k != "conditions"} == {
        k: v for k, v in running.items() if k != "conditions"}
    assert conditions(held)["VersionSkew"]["reason"] == "UnreadableSpec"


def make_async_job(status=None):
    """3 nodes: the trainer pool is ranks 0-1, the rollout pool rank 2."""
    return job_view({
        "metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                 "cluster": {"numNodes": 3}, "trainer": {"totalSteps": 20},
                 "async": {"enable": True, "rolloutPool": {"numNodes": 1}},
                 "runPolicy": {"maxRestarts": 2, "backoffSeconds": 10}},
        "status": status or {}})


def test_async_job_status_lists_both_pools_with_their_ready_nodes():
    status = status_for(make_async_job({"phase": "Starting", "attempt": 1, "startTime": EARLIER}),
                        [pod(0), pod(1, ready=False), pod(2), pod(2, attempt=0)])
    assert status["pools"] == [{"name": "trainer", "nodes": 2, "ready": 1},
                               {"name": "rollout", "nodes": 1, "ready": 1}]
    assert (status["phase"], status["nodes"]) == ("Running", "2/3")
    assert JobStatus.model_validate(status).pools[1].name == "rollout"


def test_sync_job_status_has_no_pools():
    assert "pools" not in status_for(make_job({"attempt": 1, "startTime": EARLIER}), [pod(0), pod(1)])


@pytest.mark.parametrize("rank", [1, 2], ids=["trainer-pool", "rollout-pool"])
def test_a_failure_in_either_pool_restarts_the_whole_gang(rank):
    job = make_async_job({"phase": "Running", "attempt": 1, "startTime": EARLIER})
    pods = [pod(r, phase="Failed", exit_code=1, reason="Error") if r == rank else pod(r) for r in range(3)]
    decision = decide(job, pods, NOW)
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1", "grpo-node-2"}
    status = compute_status(job, pods, decision, NOW)
    assert (status["phase"], status["attempt"], status["restarts"]) == ("Restarting", 2, 1)
    assert status["lastFailure"]["pod"] == f"grpo-node-{rank}"
    assert status["pools"] == [{"name": "trainer", "nodes": 2, "ready": 0},
                               {"name": "rollout", "nodes": 1, "ready": 0}]
    later = NOW + timedelta(seconds=30)
    # Once the old attempt is gone and the backoff has passed, every rank of both pools is created again.
    again = decide(make_async_job(status), [], later)
    assert sorted(again.create_ranks) == [0, 1, 2]


def test_scale_subresource_fields_count_current_attempt_pods_and_select_them():
    status = status_for(make_job({"phase": "Starting", "attempt": 2, "startTime": EARLIER}),
                        [pod(0, attempt=2), pod(1, attempt=2, phase="Pending"), pod(0, attempt=1)])
    assert (status["replicas"], status["desiredNodes"]) == (1, 2)
    assert status["selector"] == "app.kubernetes.io/managed-by=distflow-operator,distflow.io/job-name=grpo"
    assert status_for(make_job(), [])["replicas"] == 0
