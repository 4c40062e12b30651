"""Resize decisions (cluster.numNodes changed, ``kubectl scale``): a running gang is asked to stop at a
step boundary, its exit code 3 starts the new size without a restart, a gang not running is replaced."""

from __future__ import annotations

from datetime import timedelta

import pytest

from distflow_operator.observed import format_time
from distflow_operator.policy import decide
from distflow_operator.status import compute_status, transition_events
from tests.unit.test_policy import NOW, ago, make_job, pod

pytestmark = pytest.mark.unit

POLICY = {"maxRestarts": 2, "backoffSeconds": 10}


def job(nodes, status, batch=12, **kw):
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": batch},
            "cluster": {"numNodes": nodes}, "runPolicy": POLICY}
    return make_job(status, spec=spec, **kw)


def running(nodes=2, attempt=1, **extra):
    return {"phase": "Running", "attempt": attempt, "restarts": 0, "startTime": ago(300),
            "attemptNodes": nodes, **extra}


def requested(from_nodes=2, to_nodes=3, at=60):
    return {"from": from_nodes, "to": to_nodes, "requestedAt": ago(at)}


def test_a_running_gang_is_asked_to_stop_and_keeps_running_meanwhile():
    decision = decide(job(3, running()), [pod(0), pod(1)], NOW)
    assert decision.resize_request == 3
    assert (decision.restart, decision.delete_pods, decision.create_ranks) == (None, (), ())
    resize = decision.state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.requested_at, resize.stopped_at) == (2, 3, NOW, None)
    status = compute_status(job(3, running()), [pod(0), pod(1)], decision, NOW)
    assert status["phase"] == "Running" and status["attemptNodes"] == 2 and status["desiredNodes"] == 3
    assert status["resizing"] == {"from": 2, "to": 3, "requestedAt": format_time(NOW)}
    assert [e[1] for e in transition_events(running(), status)] == ["ResizeRequested"]
    # The next pass keeps the request (and when it was made) as it is.
    again = decide(job(3, running(resizing=requested())), [pod(0), pod(1)], NOW)
    assert again.resize_request == 3 and again.state.resizing.requested_at == NOW - timedelta(seconds=60)


def test_the_first_exit_3_starts_the_new_size_without_a_restart_or_backoff():
    status = running(resizing=requested(), lastRestartTime=ago(5), restarts=1)
    stopped = pod(1, phase="Failed", exit_code=3, reason="Error")
    decision = decide(job(3, status), [pod(0), stopped], NOW)
    assert decision.state.attempt == 2 and decision.state.restarts == 1 and decision.state.disruptions == 0
    assert decision.restart.reason == "Resizing" and "not a restart" in decision.restart.message
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1"}
    assert decision.requeue_after is None and decision.resize_request is None
    resize = decision.state.resizing
    assert (resize.stopped_at, resize.attempt, resize.to_nodes) == (NOW, 2, 3)
    # Old pods gone: all three ranks of attempt 2 at once, although the last restart was 5 s ago.
    after = compute_status(job(3, status), [pod(0), stopped], decision, NOW)
    assert after["phase"] == "Restarting" and after["restarts"] == 1 and "attemptNodes" not in after
    create = decide(job(3, after), [], NOW + timedelta(seconds=1))
    assert create.create_ranks == (0, 1, 2) and create.state.attempt_nodes == 3


def test_the_resize_is_done_when_every_pod_of_the_new_size_runs_and_its_cost_is_recorded():
    resize = {**requested(), "stoppedAt": ago(30), "attempt": 2}
    status = {**running(3, attempt=2), "phase": "Restarting", "resizing": resize}
    starting = decide(job(3, status), [pod(0, 2), pod(1, 2), pod(2, 2, phase="Pending")], NOW)
    assert starting.state.resizing is not None and starting.state.last_resize is None
    decision = decide(job(3, status), [pod(0, 2), pod(1, 2), pod(2, 2)], NOW)
    assert decision.state.resizing is None
    done = decision.state.last_resize
    assert (done.from_nodes, done.to_nodes, done.resumed_at, done.cost_seconds) == (2, 3, NOW, 30.0)
    new = compute_status(job(3, status), [pod(0, 2), pod(1, 2), pod(2, 2)], decision, NOW)
    assert new["phase"] == "Running" and new["restarts"] == 0 and "resizing" not in new
    assert new["lastResize"] == {"from": 2, "to": 3, "requestedAt": ago(60), "stoppedAt": ago(30),
                                 "resumedAt": format_time(NOW), "attempt": 2, "costSeconds": 30.0}
    events = {e[1]: e for e in transition_events(status, new)}
    assert "30s from the stop" in events["Resized"][2] and events["Resized"][0] == "Normal"
    # Later passes keep the record as it is: no second Resized event.
    later = NOW + timedelta(seconds=7.5)
    pods = [pod(0, 2), pod(1, 2), pod(2, 2)]
    steady = compute_status(job(3, new), pods, decide(job(3, new), pods, later), later)
    assert steady["lastResize"] == new["lastResize"] and transition_events(new, steady) == []


def test_the_cost_keeps_the_milliseconds_the_status_times_do_not_have():
    resize = {**requested(), "stoppedAt": ago(30), "attempt": 2}
    status = {**running(3, attempt=2), "phase": "Restarting", "resizing": resize}
    pods = [pod(0, 2), pod(1, 2), pod(2, 2)]
    decision = decide(job(3, status), pods, NOW + timedelta(seconds=1.2344))
    assert decision.state.last_resize.cost_seconds == 31.234


def test_a_gang_that_has_not_started_is_replaced_at_the_new_size_directly():
    status = {**running(), "phase": "Starting"}
    decision = decide(job(3, status), [pod(0), pod(1, phase="Pending")], NOW)
    assert decision.resize_request is None and decision.restart.reason == "Resizing"
    assert decision.state.attempt == 2 and decision.state.restarts == 0 and decision.state.disruptions == 0
    assert len(decision.delete_pods) == 2 and decision.state.resizing.stopped_at == NOW


def test_exit_3_without_a_request_restarts_uncounted_with_backoff_so_it_cannot_loop():
    stopped = pod(0, phase="Failed", exit_code=3)
    decision = decide(job(2, running()), [stopped, pod(1)], NOW)
    assert decision.restart.reason == "StoppedWithoutResize"
    assert (decision.state.attempt, decision.state.restarts, decision.state.disruptions) == (2, 0, 1)
    assert decision.requeue_after == 10  # backoff, as for any restart not counted in maxRestarts


def test_a_size_set_back_before_the_stop_withdraws_the_request():
    decision = decide(job(2, running(resizing=requested())), [pod(0), pod(1)], NOW)
    assert decision.state.resizing is None and decision.resize_request is None and decision.restart is None


def test_a_failure_before_the_stop_is_an_ordinary_restart_at_the_new_size():
    failed = pod(0, phase="Failed", exit_code=1, reason="Error")
    decision = decide(job(3, running(resizing=requested())), [failed, pod(1)], NOW)
    assert decision.restart.reason == "NodeFailed" and decision.state.restarts == 1
    assert decision.state.resizing is None and decision.requeue_after == 10
    after = compute_status(job(3, running()), [failed, pod(1)], decision, NOW)
    later = decide(job(3, after), [], NOW + timedelta(seconds=11))
    assert later.create_ranks == (0, 1, 2)


def test_a_size_the_spec_refuses_keeps_the_job_running_with_a_reason():
    # trainBatchSize 4 cannot be split over 3 nodes: the API server's CEL rules refuse it first;
    # an operator that still sees it holds the job at its size.
    status = running()
    decision = decide(job(3, status, batch=4), [pod(0), pod(1)], NOW)
    assert decision.held.reason == "ResizeRefused" and "keeps running at 2 nodes" in decision.held.message
    assert "trainBatchSize" in decision.held.message
    assert (decision.delete_pods, decision.create_ranks, decision.terminal) == ((), (), None)
    # A request made before for a valid size is withdrawn while the job is held.
    held = decide(job(3, running(resizing=requested()), batch=4), [pod(0), pod(1)], NOW)
    assert held.held.reason == "ResizeRefused" and held.resize_request is None


def test_without_a_recorded_size_the_pods_tell_the_attempts_size():
    status = {"phase": "Running", "attempt": 1, "startTime": ago(300)}  # an older operator's status
    pods = [pod(0, num_nodes=2), pod(1, num_nodes=2)]
    assert decide(job(2, status), pods, NOW).resize_request is None
    assert decide(job(3, status), pods, NOW).resize_request == 3
    assert decide(job(1, status, batch=4), pods, NOW).resize_request == 1
