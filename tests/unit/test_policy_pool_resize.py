"""In-place resize of the rollout pool (async.enable; ``distflow.pools.elastic``): a spec that changes
async.rolloutPool.numNodes and cluster.numNodes by the same amount while the gang runs grows or
shrinks the rollout pool in the running attempt; the trainer pods are never touched."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from distflow_operator.observed import format_time
from distflow_operator.policy import decide
from distflow_operator.render import JobRef, build_config_map, build_node_pod, resize_request_value
from distflow_operator.status import compute_status, transition_events
from tests.unit.test_policy import NOW, ago, make_job, pod

pytestmark = pytest.mark.unit


def job(nodes, rollout, status):
    spec = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
            "cluster": {"numNodes": nodes}, "async": {"enable": True, "rolloutPool": {"numNodes": rollout}},
            "runPolicy": {"maxRestarts": 2, "backoffSeconds": 10}}
    return make_job(status, spec=spec)


def running(nodes, rollout, **extra):
    return {"phase": "Running", "attempt": 1, "restarts": 0, "startTime": ago(300),
            "attemptNodes": nodes, "attemptRolloutNodes": rollout, **extra}


def in_flight(from_nodes, to_nodes, at=20):
    return {"from": from_nodes, "to": to_nodes, "requestedAt": ago(at), "attempt": 1, "inPlace": True}


def test_a_new_async_gang_records_its_rollout_nodes():
    decision = decide(job(2, 1, {}), [], NOW)
    assert decision.create_ranks == (0, 1)
    assert (decision.state.attempt_nodes, decision.state.attempt_rollout_nodes) == (2, 1)


def test_grow_creates_only_the_joining_rank_and_asks_the_running_pods_in_place():
    decision = decide(job(3, 2, running(2, 1)), [pod(0), pod(1)], NOW)
    assert decision.create_ranks == (2,) and decision.joining is True
    assert (decision.resize_request, decision.resize_rollout_nodes) == (3, 2)
    assert (decision.restart, decision.delete_pods) == (None, ())
    resize = decision.state.resizing
    assert (resize.from_nodes, resize.to_nodes, resize.in_place, resize.attempt, resize.stopped_at) == (2, 3, True, 1, None)
    assert decision.state.attempt == 1 and decision.state.attempt_nodes == 2
    status = compute_status(job(3, 2, running(2, 1)), [pod(0), pod(1)], decision, NOW)
    assert status["phase"] == "Running" and status["restarts"] == 0
    assert status["resizing"] == {"from": 2, "to": 3, "requestedAt": format_time(NOW), "attempt": 1, "inPlace": True}
    events = {e[1]: e for e in transition_events(running(2, 1), status)}
    assert "in place" in events["ResizeRequested"][2]


def test_grow_is_done_when_the_joining_pod_runs():
    status = running(2, 1, resizing=in_flight(2, 3))
    waiting = decide(job(3, 2, status), [pod(0), pod(1), pod(2, phase="Pending")], NOW)
    assert waiting.create_ranks == () and waiting.state.resizing is not None
    assert waiting.resize_request == 3 and waiting.resize_rollout_nodes == 2
    decision = decide(job(3, 2, status), [pod(0), pod(1), pod(2)], NOW)
    assert decision.state.resizing is None and decision.create_ranks == () and decision.delete_pods == ()
    assert (decision.state.attempt, decision.state.attempt_nodes, decision.state.attempt_rollout_nodes) == (1, 3, 2)
    done = decision.state.last_resize
    assert (done.from_nodes, done.to_nodes, done.in_place, done.resumed_at, done.cost_seconds) == (2, 3, True, NOW, 20.0)
    # The request stays in the ConfigMap, at the sizes the gang now runs at: a no-op for the workers.
    assert (decision.resize_request, decision.resize_rollout_nodes) == (3, 2)
    new = compute_status(job(3, 2, status), [pod(0), pod(1), pod(2)], decision, NOW)
    assert new["phase"] == "Running" and new["restarts"] == 0 and new["attemptNodes"] == 3
    assert new["lastResize"]["inPlace"] is True and new["lastResize"]["costSeconds"] == 20.0
    events = {e[1]: e for e in transition_events(status, new)}
    assert "in place from 2 to 3" in events["Resized"][2]


def test_shrink_requests_in_place_and_deletes_the_pod_that_left_with_exit_4():
    decision = decide(job(2, 1, running(3, 2)), [pod(0), pod(1), pod(2)], NOW)
    assert (decision.resize_request, decision.resize_rollout_nodes) == (2, 1)
    assert (decision.create_ranks, decision.delete_pods, decision.restart) == ((), (), None)
    assert decision.state.resizing.in_place and decision.state.resizing.to_nodes == 2
    status = running(3, 2, resizing=in_flight(3, 2))
    left = pod(2, phase="Failed", exit_code=4, reason="Error", message="LeftPool")
    leaving = decide(job(2, 1, status), [pod(0), pod(1), left], NOW)
    assert leaving.restart is None and leaving.terminal is None and leaving.state.restarts == 0
    assert [p.name for p in leaving.delete_pods] == ["grpo-node-2"]
    assert compute_status(job(2, 1, status), [pod(0), pod(1), left], leaving, NOW)["phase"] == "Running"
    # Gone: the shrink is done, and the pod's disappearance is no lost node.
    gone = decide(job(2, 1, status), [pod(0), pod(1)], NOW, lost={"grpo-node-2"})
    assert gone.restart is None and gone.state.resizing is None and gone.state.restarts == 0
    assert (gone.state.attempt_nodes, gone.state.attempt_rollout_nodes) == (2, 1)
    assert gone.state.last_resize.in_place and gone.state.last_resize.cost_seconds == 20.0
    after = running(2, 1, lastResize={**in_flight(3, 2), "resumedAt": ago(1), "costSeconds": 19.0})
    later = decide(job(2, 1, after), [pod(0), pod(1)], NOW, lost={"grpo-node-2"})
    assert later.restart is None and later.create_ranks == ()


def test_exit_4_without_an_in_place_shrink_is_a_failure():
    left = pod(1, phase="Failed", exit_code=4, reason="Error")
    decision = decide(job(2, 1, running(2, 1)), [pod(0), left], NOW)
    assert decision.restart is not None and decision.state.restarts == 1 and decision.state.attempt == 2


def test_a_failure_during_an_in_place_resize_restarts_the_gang_at_the_specs_size():
    status = running(2, 1, resizing=in_flight(2, 3))
    crashed = pod(0, phase="Failed", exit_code=1, reason="Error")
    decision = decide(job(3, 2, status), [crashed, pod(1), pod(2, phase="Pending")], NOW)
    assert decision.restart is not None and decision.state.restarts == 1 and decision.state.attempt == 2
    assert decision.state.resizing is None
    later = decide(job(3, 2, compute_status(job(3, 2, status), [], decision, NOW)), [], NOW + timedelta(seconds=60))
    assert later.create_ranks == (0, 1, 2) and later.joining is False


def test_a_trainer_count_change_is_a_whole_gang_resize():
    decision = decide(job(3, 1, running(2, 1)), [pod(0), pod(1)], NOW)
    assert decision.resize_request == 3 and decision.resize_rollout_nodes is None
    assert decision.create_ranks == () and not decision.state.resizing.in_place


def test_a_gang_not_running_yet_is_replaced_at_the_new_size():
    decision = decide(job(3, 2, running(2, 1)), [pod(0), pod(1, phase="Pending")], NOW)
    assert decision.restart is not None and decision.restart.reason == "Resizing"
    assert not decision.state.resizing.in_place


def test_a_status_without_rollout_nodes_resizes_the_whole_gang():
    status = running(2, 1)
    del status["attemptRolloutNodes"]
    decision = decide(job(3, 2, status), [pod(0), pod(1)], NOW)
    assert decision.resize_request == 3 and decision.resize_rollout_nodes is None and decision.create_ranks == ()


def test_the_joining_pod_and_the_configmap_carry_the_new_size_and_the_request():
    spec = job(3, 2, {}).spec
    owner = JobRef("grpo", "ns", "u1")
    env = {e["name"]: e["value"] for e in build_node_pod(spec, owner, 2, 1, joining=True)["spec"]["containers"][0]["env"]}
    assert (env["DISTFLOW_JOIN"], env["PET_NNODES"], env["PET_NODE_RANK"], env["DISTFLOW_ATTEMPT"]) == ("1", "3", "2", "1")
    plain = build_node_pod(spec, owner, 1, 1)["spec"]["containers"][0]["env"]
    assert "DISTFLOW_JOIN" not in {e["name"] for e in plain}
    data = build_config_map(spec, owner, resize_request_value(3, 2))["data"]
    assert json.loads(data["resize"]) == {"numNodes": 3, "rolloutNodes": 2}
    assert "numNodes: 3" in data["spec.yaml"]
