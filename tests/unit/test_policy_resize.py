"""Resize decisions (cluster.numNodes changed, ``kubectl scale``). A synchronous job is resized in place:
the surviving pods keep running, a grow's new ranks join the same attempt (``DISTFLOW_JOIN=1``), a
shrink's leaving ranks exit 4 and are deleted, nothing is counted. A worker image that stops instead
(exit 3) gets the stop path: the new size as the next attempt, no restart counted. That stop path is
also what a request pending from an older operator's status takes; a gang not running is replaced."""

from __future__ import annotations

from dataclasses import replace
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


def async_job(nodes, rollout, status):
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
            "cluster": {"numNodes": nodes}, "async": {"enable": True, "rolloutPool": {"numNodes": rollout}},
            "runPolicy": POLICY}
    return make_job(status, spec=spec)


def running(nodes=2, attempt=1, **extra):
    return {"phase": "Running", "attempt": attempt, "restarts": 0, "startTime": ago(300),
            "attemptNodes": nodes, **extra}


def requested(from_nodes=2, to_nodes=3, at=60):
    """A stop request pending (the workers asked to stop; an older operator's, or an async trainer change)."""
    return {"from": from_nodes, "to": to_nodes, "requestedAt": ago(at)}


def in_flight(from_nodes=2, to_nodes=3, at=20):
    """An in-place resize of the whole gang in flight in attempt 1."""
    return {"from": from_nodes, "to": to_nodes, "requestedAt": ago(at), "attempt": 1, "inPlace": True}


def left(rank):
    return pod(rank, phase="Failed", exit_code=4, reason="Error", message="LeftPool")


# -- in place -------------------------------------------------------------------------------------


def test_grow_creates_the_new_ranks_joining_the_same_attempt_with_an_in_place_request():
    decision = decide(job(4, running()), [pod(0), pod(1)], NOW)
    assert decision.create_ranks == (2, 3) and decision.joining is True
    assert (decision.resize_request, decision.resize_in_place, decision.resize_rollout_nodes) == (4, True, None)
    assert (decision.restart, decision.delete_pods) == (None, ())
    state = decision.state
    assert (state.attempt, state.attempt_nodes, state.attempt_rollout_nodes, state.restarts) == (1, 2, None, 0)
    resize = state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.requested_at, resize.attempt, resize.in_place,
            resize.stopped_at) == (2, 4, NOW, 1, True, None)
    status = compute_status(job(4, running()), [pod(0), pod(1)], decision, NOW)
    assert (status["phase"], status["attemptNodes"], status["desiredNodes"], status["restarts"]) == ("Running", 2, 4, 0)
    assert status["resizing"] == {"from": 2, "to": 4, "requestedAt": format_time(NOW), "attempt": 1, "inPlace": True}
    events = {e[1]: e[2] for e in transition_events(running(), status)}
    assert events["ResizeRequested"] == ("cluster.numNodes 2 -> 4: the gang resizes in place: the running pods "
                                         "keep training, new ranks 2..3 join at a step boundary")


def test_grow_is_done_when_every_rank_runs_and_records_its_cost():
    status = running(resizing=in_flight())
    waiting = decide(job(3, status), [pod(0), pod(1), pod(2, phase="Pending")], NOW)
    assert waiting.create_ranks == () and waiting.state.resizing is not None and waiting.restart is None
    assert (waiting.resize_request, waiting.resize_in_place) == (3, True)
    assert compute_status(job(3, status), [pod(0), pod(1), pod(2, phase="Pending")], waiting, NOW)["phase"] == "Running"
    pods = [pod(0), pod(1), pod(2)]
    decision = decide(job(3, status), pods, NOW)
    assert decision.state.resizing is None and (decision.create_ranks, decision.delete_pods) == ((), ())
    assert (decision.state.attempt, decision.state.attempt_nodes, decision.state.attempt_rollout_nodes) == (1, 3, None)
    # The request stays in the ConfigMap at the size the gang now runs at: a rank reading late re-forms too.
    assert (decision.resize_request, decision.resize_in_place, decision.resize_rollout_nodes) == (3, True, None)
    new = compute_status(job(3, status), pods, decision, NOW)
    assert (new["phase"], new["restarts"], new["attemptNodes"], new["replicas"]) == ("Running", 0, 3, 3)
    assert "resizing" not in new
    assert new["lastResize"] == {"from": 2, "to": 3, "requestedAt": ago(20), "resumedAt": format_time(NOW),
                                 "attempt": 1, "costSeconds": 20.0, "inPlace": True}
    events = {e[1]: e[2] for e in transition_events(status, new)}
    assert events["Resized"] == "gang resized in place from 2 to 3 nodes (attempt 1, no restart): 20s from the request"
    later = decide(job(3, new), pods, NOW + timedelta(seconds=30))
    assert (later.resize_request, later.resize_in_place, later.create_ranks, later.delete_pods) == (3, True, (), ())


def test_shrink_deletes_the_ranks_that_exited_4_and_counts_nothing():
    decision = decide(job(1, running(3)), [pod(0), pod(1), pod(2)], NOW)
    assert (decision.resize_request, decision.resize_in_place) == (1, True)
    assert (decision.create_ranks, decision.delete_pods, decision.restart) == ((), (), None)
    assert decision.state.resizing.in_place and decision.state.resizing.to_nodes == 1
    status = running(3, resizing=in_flight(3, 1))
    leaving = decide(job(1, status), [pod(0), left(1), left(2)], NOW)
    assert [p.name for p in leaving.delete_pods] == ["grpo-node-1", "grpo-node-2"]
    assert (leaving.restart, leaving.terminal, leaving.state.restarts) == (None, None, 0)
    assert leaving.state.last_failure is None
    assert (leaving.resize_request, leaving.resize_in_place) == (1, True)
    assert compute_status(job(1, status), [pod(0), left(1), left(2)], leaving, NOW)["phase"] == "Running"
    # One gone, one still deleting: not done yet, and no failure.
    partly = decide(job(1, status), [pod(0), replace(left(2), deleting=True)], NOW)
    assert (partly.restart, partly.state.resizing is not None, partly.delete_pods) == (None, True, ())
    # Gone (lost: deleted by someone else than the operator, which does not count its own deletions).
    gone = decide(job(1, status), [pod(0)], NOW, lost={"grpo-node-1", "grpo-node-2"})
    assert gone.restart is None and gone.state.resizing is None and gone.state.restarts == 0
    assert (gone.state.attempt, gone.state.attempt_nodes) == (1, 1)
    done = gone.state.last_resize
    assert (done.from_nodes, done.to_nodes, done.in_place, done.cost_seconds) == (3, 1, True, 20.0)
    after = compute_status(job(1, status), [pod(0)], gone, NOW)
    later = decide(job(1, after), [pod(0)], NOW + timedelta(seconds=5), lost={"grpo-node-1", "grpo-node-2"})
    assert (later.restart, later.create_ranks, later.resize_request, later.resize_in_place) == (None, (), 1, True)


def test_a_size_set_back_withdraws_an_in_place_grow_and_deletes_its_joiners():
    status = running(resizing=in_flight())
    joiner = pod(2, phase="Pending")
    decision = decide(job(2, status), [pod(0), pod(1), joiner], NOW)
    assert decision.state.resizing is None and decision.restart is None and decision.create_ranks == ()
    assert [p.name for p in decision.delete_pods] == ["grpo-node-2"]
    assert (decision.resize_request, decision.resize_in_place) == (2, True)
    after = compute_status(job(2, status), [pod(0), pod(1), joiner], decision, NOW)
    assert (after["phase"], after["replicas"], after["attemptNodes"], after["restarts"]) == ("Running", 2, 2, 0)
    assert "resizing" not in after and "lastResize" not in after
    # The joiner terminating, then gone: no lost node, no restart, nothing created.
    terminating = decide(job(2, after), [pod(0), pod(1), replace(joiner, deleting=True)], NOW + timedelta(seconds=1))
    assert (terminating.restart, terminating.create_ranks, terminating.state.restarts) == (None, (), 0)
    gone = decide(job(2, after), [pod(0), pod(1)], NOW + timedelta(seconds=2), lost={"grpo-node-2"})
    assert (gone.restart, gone.create_ranks, gone.delete_pods, gone.state.restarts) == (None, (), (), 0)


def test_a_size_set_back_withdraws_a_shrink_no_rank_has_left_yet_but_not_one_carried_out():
    status = running(3, resizing=in_flight(3, 2))
    withdrawn = decide(job(3, status), [pod(0), pod(1), pod(2)], NOW)
    assert withdrawn.state.resizing is None and withdrawn.delete_pods == () and withdrawn.restart is None
    assert (withdrawn.resize_request, withdrawn.resize_in_place, withdrawn.state.attempt_nodes) == (3, True, 3)
    # Rank 2 already left: the shrink is finished first (its pod deleted, no failure), the grow back comes next.
    carried_out = decide(job(3, status), [pod(0), pod(1), left(2)], NOW)
    assert carried_out.state.resizing.to_nodes == 2 and carried_out.restart is None
    assert [p.name for p in carried_out.delete_pods] == ["grpo-node-2"]
    # Done, and the grow back to the spec's size starts in the same pass, in the same attempt.
    done = decide(job(3, status), [pod(0), pod(1)], NOW)
    assert (done.state.attempt, done.state.attempt_nodes, done.state.last_resize.to_nodes) == (1, 2, 2)
    assert done.create_ranks == (2,) and done.joining and done.restart is None
    assert (done.state.resizing.from_nodes, done.state.resizing.to_nodes, done.resize_request) == (2, 3, 3)


def test_a_third_size_waits_for_the_resize_in_flight_then_starts_from_its_size():
    status = running(resizing=in_flight())
    pods = [pod(0), pod(1), pod(2, phase="Pending")]
    waiting = decide(job(4, status), pods, NOW)
    assert waiting.state.resizing.to_nodes == 3 and waiting.create_ranks == () and waiting.delete_pods == ()
    assert (waiting.resize_request, waiting.resize_in_place) == (3, True)
    # Done at 3, then the next one from 3 to 4 starts in the same pass.
    done = decide(job(4, status), [pod(0), pod(1), pod(2)], NOW)
    assert (done.state.attempt_nodes, done.state.last_resize.to_nodes) == (3, 3)
    assert done.create_ranks == (3,) and (done.resize_request, done.resize_in_place) == (4, True)
    assert (done.state.resizing.from_nodes, done.state.resizing.to_nodes, done.state.attempt) == (3, 4, 1)
    # A grow whose joiner was never created (refused) would get it created for the third size: withdrawn.
    uncreated = decide(job(4, status), [pod(0), pod(1)], NOW)
    assert uncreated.state.resizing is None and uncreated.create_ranks == () and uncreated.resize_request == 2


def test_exit_3_during_an_in_place_resize_is_an_older_image_and_takes_the_stop_path():
    status = running(resizing=in_flight(), lastRestartTime=ago(5), restarts=1)
    stopped = pod(1, phase="Failed", exit_code=3, reason="Error")
    pods = [pod(0), stopped, pod(2, phase="Pending")]
    decision = decide(job(3, status), pods, NOW)
    assert (decision.state.attempt, decision.state.restarts, decision.state.disruptions) == (2, 1, 0)
    assert decision.restart.reason == "Resizing"
    assert decision.restart.message == (
        "node pod grpo-node-1 stopped at a step boundary instead of resizing in place (a worker image without "
        "it) for a resize from 2 to 3 nodes (checkpoint saved); starting attempt 2 at 3 nodes (not a restart)")
    assert {p.name for p in decision.delete_pods} == {"grpo-node-0", "grpo-node-1", "grpo-node-2"}
    assert decision.requeue_after is None and decision.resize_request is None and decision.create_ranks == ()
    resize = decision.state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.requested_at, resize.stopped_at, resize.attempt,
            resize.in_place) == (2, 3, NOW - timedelta(seconds=20), NOW, 2, False)
    after = compute_status(job(3, status), pods, decision, NOW)
    create = decide(job(3, after), [], NOW + timedelta(seconds=1))  # no backoff: 5 s after the last restart
    assert create.create_ranks == (0, 1, 2) and create.joining is False and create.state.attempt_nodes == 3


def test_exit_3_after_an_in_place_grow_is_done_takes_the_stop_path_too():
    done = {**in_flight(), "resumedAt": ago(5), "costSeconds": 15.0}
    stopped = pod(0, phase="Failed", exit_code=3, reason="Error")
    decision = decide(job(3, running(3, lastResize=done)), [stopped, pod(1), pod(2)], NOW)
    assert decision.restart.reason == "Resizing" and decision.state.attempt == 2
    assert (decision.state.restarts, decision.state.disruptions, decision.requeue_after) == (0, 0, None)
    resize = decision.state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.attempt, resize.stopped_at, resize.resumed_at,
            resize.cost_seconds, resize.in_place) == (2, 3, 2, NOW, None, None, False)


def _growing(pods):
    """The status after a grow 2 -> 3 started in place (its joiner created, attempt 1)."""
    grow = decide(job(3, running()), [pod(0), pod(1)], NOW)
    assert grow.create_ranks == (2,) and grow.state.resizing.in_place
    return compute_status(job(3, running()), pods, grow, NOW)


def test_a_failure_during_an_in_place_resize_restarts_the_gang_at_the_specs_size():
    crashed = pod(0, phase="Failed", exit_code=1, reason="Error")
    pods = [crashed, pod(1), pod(2, phase="Pending")]
    status = _growing(pods)
    decision = decide(job(3, status), pods, NOW + timedelta(seconds=5))
    assert decision.restart.reason == "NodeFailed" and decision.state.restarts == 1 and decision.state.attempt == 2
    assert decision.state.resizing is None and decision.requeue_after == 10 and len(decision.delete_pods) == 3
    assert decision.resize_request is None
    after = compute_status(job(3, status), [], decision, NOW + timedelta(seconds=5))
    later = decide(job(3, after), [], NOW + timedelta(seconds=16))
    assert later.create_ranks == (0, 1, 2) and later.joining is False and later.resize_request is None
    assert later.state.attempt_nodes == 3


def test_exit_4_of_a_rank_no_shrink_removes_is_a_failure_even_during_a_grow():
    pods = [pod(0), left(1), pod(2, phase="Pending")]
    decision = decide(job(3, _growing(pods)), pods, NOW + timedelta(seconds=5))
    assert decision.restart.reason == "NodeFailed" and decision.state.restarts == 1
    assert decision.state.last_failure.exit_code == 4 and decision.state.last_failure.rank == 1


def test_exit_3_during_an_in_place_resize_of_the_rollout_pool_is_no_stop():
    status = running(2, attemptRolloutNodes=1, resizing=in_flight())
    stopped = decide(async_job(3, 2, status), [pod(0), pod(1, phase="Failed", exit_code=3), pod(2)], NOW)
    assert stopped.restart.reason == "StoppedWithoutResize" and stopped.state.disruptions == 1
    assert stopped.state.resizing is None and stopped.requeue_after == 10


# -- the stop path ----------------------------------------------------------------------------------


def test_a_trainer_count_change_asks_the_running_gang_to_stop_and_keeps_it_running_meanwhile():
    status = running(2, attemptRolloutNodes=1)
    decision = decide(async_job(3, 1, status), [pod(0), pod(1)], NOW)
    assert (decision.resize_request, decision.resize_in_place, decision.resize_rollout_nodes) == (3, False, None)
    assert (decision.restart, decision.delete_pods, decision.create_ranks) == (None, (), ())
    resize = decision.state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.requested_at, resize.stopped_at, resize.in_place) == \
        (2, 3, NOW, None, False)
    new = compute_status(async_job(3, 1, status), [pod(0), pod(1)], decision, NOW)
    assert (new["phase"], new["attemptNodes"], new["desiredNodes"]) == ("Running", 2, 3)
    assert new["resizing"] == {"from": 2, "to": 3, "requestedAt": format_time(NOW)}
    events = {e[1]: e[2] for e in transition_events(status, new)}
    assert "the workers stop at their next step boundary" in events["ResizeRequested"]
    # The next pass keeps the request (and when it was made) as it is.
    again = decide(async_job(3, 1, {**status, "resizing": requested()}), [pod(0), pod(1)], NOW)
    assert again.resize_request == 3 and again.state.resizing.requested_at == NOW - timedelta(seconds=60)


def test_a_gang_that_trained_its_last_step_before_an_in_place_resize_succeeded():
    done = [pod(r, phase="Succeeded", exit_code=0, reason="Completed") for r in range(3)]
    # a shrink 3 -> 2 asked for after the last boundary: the three ranks all exited 0
    shrink = decide(job(2, running(3, resizing=in_flight(3, 2))), done, NOW)
    assert shrink.terminal is not None and (shrink.terminal.phase, shrink.terminal.message) == \
        ("Succeeded", "all 3 nodes exited 0 (attempt 1)")
    # a grow 2 -> 3 whose new pod never joined: the two ranks exited 0, the new pod is deleted
    grow = decide(job(3, running(2, resizing=in_flight(2, 3))), done[:2] + [pod(2)], NOW)
    assert grow.terminal.phase == "Succeeded" and [p.rank for p in grow.delete_pods] == [2]
    # without a resize in flight, the spec's size is the gang's
    assert decide(job(3, running(3)), done[:2] + [pod(2)], NOW).terminal is None


def test_a_job_with_a_colocated_vllm_engine_stops_for_a_resize_instead():
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 12},
            "rollout": {"engine": "vllm"}, "cluster": {"numNodes": 3}, "runPolicy": POLICY}
    decision = decide(make_job(running(), spec=spec), [pod(0), pod(1)], NOW)
    assert (decision.resize_request, decision.resize_in_place, decision.create_ranks) == (3, False, ())
    assert decision.state.resizing.in_place is False


def test_the_first_exit_3_starts_the_new_size_without_a_restart_or_backoff():
    status = running(resizing=requested(), lastRestartTime=ago(5), restarts=1)
    stopped = pod(1, phase="Failed", exit_code=3, reason="Error")
    decision = decide(job(3, status), [pod(0), stopped], NOW)
    assert decision.state.attempt == 2 and decision.state.restarts == 1 and decision.state.disruptions == 0
    assert decision.restart.reason == "Resizing" and "not a restart" in decision.restart.message
    assert "instead of resizing in place" not in decision.restart.message
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
    # Later passes keep the record as it is: no second Resized event, and no request (a stop's is dropped).
    later = NOW + timedelta(seconds=7.5)
    pods = [pod(0, 2), pod(1, 2), pod(2, 2)]
    steady_decision = decide(job(3, new), pods, later)
    assert steady_decision.resize_request is None
    steady = compute_status(job(3, new), pods, steady_decision, later)
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
    assert decision.create_ranks == () and not decision.state.resizing.in_place


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
