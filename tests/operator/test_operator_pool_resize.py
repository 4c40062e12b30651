"""The rollout pool of an asynchronous job resized in place on the real API server: a spec patch that
changes async.rolloutPool.numNodes and cluster.numNodes by the same amount grows the pool by a
joining pod (``DISTFLOW_JOIN=1``) or shrinks it (the leaving rank's exit 4, played here by a status
patch as kwok runs no container, deletes its pod), in the running attempt: the other pods keep their
uids, nothing restarts. Exit 4 with no shrink asked is a failure; a trainer-count change resizes the
whole gang as before."""

from __future__ import annotations

import json

import pytest

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, operator, operator_kubeconfig_path, wait_for,
)
from tests.operator.test_operator_pools import async_job

pytestmark = pytest.mark.operator


def pool_job(name: str, num_nodes: int, rollout_nodes: int) -> dict:
    """The async example at ``num_nodes`` nodes, ``rollout_nodes`` of them rollout, without the
    example's resize bounds (minNodes 3, maxNodes 5 for its autoscaler): the sizes here are 2 and 3."""
    doc = async_job(name)
    for bound in ("minNodes", "maxNodes"):
        doc["spec"]["cluster"].pop(bound, None)
    doc["spec"]["cluster"]["numNodes"] = num_nodes
    doc["spec"]["async"]["rolloutPool"] = {"numNodes": rollout_nodes}
    return doc


def _start(api, name: str, num_nodes: int, rollout_nodes: int) -> dict[str, str]:
    code, body = api.create_job(pool_job(name, num_nodes, rollout_nodes))
    assert code == 201, body
    pods = api.wait_running_gang(name, attempt=1, num_nodes=num_nodes)
    api.wait_phase(name, "Running", attemptNodes=num_nodes, attemptRolloutNodes=rollout_nodes)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


def _patch(control_plane, namespace: str, name: str, num_nodes: int, rollout_nodes: int) -> None:
    patch = {"spec": {"cluster": {"numNodes": num_nodes}, "async": {"rolloutPool": {"numNodes": rollout_nodes}}}}
    out = control_plane.kubectl("patch", "-n", namespace, "rljob", name, "--type", "merge", "-p", json.dumps(patch))
    assert out.returncode == 0, out.stderr


def _request(api, name: str) -> dict | None:
    data = (api.get("configmaps", f"{name}-config") or {}).get("data") or {}
    return json.loads(data["resize"]) if "resize" in data else None


def _uids(api, name: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.live_pods(name)}


def assert_grown_in_place(api, name: str, before: dict[str, str], **fields) -> dict:
    """The job's status once its in-place grow from 2 to 3 nodes is done (``fields``: more status
    values to wait for): attempt 1, nothing counted, lastResize in place with its cost, and the
    running pods kept (``before``: their uids) beside the one new pod."""
    api.wait_running_gang(name, attempt=1, num_nodes=3)
    status = api.wait_phase(name, "Running", attemptNodes=3, **fields)
    assert (status["attempt"], status["restarts"], status["disruptions"], status["replicas"]) == (1, 0, 0, 3)
    assert "resizing" not in status and "lastFailure" not in status
    done = status["lastResize"]
    assert (done["from"], done["to"], done["attempt"], done["inPlace"]) == (2, 3, 1, True)
    assert "stoppedAt" not in done and done["requestedAt"] <= done["resumedAt"] and done["costSeconds"] >= 0
    now = _uids(api, name)
    assert {k: now[k] for k in before} == before and set(now) == set(before) | {f"{name}-node-2"}
    return status


def test_grow_creates_only_the_joining_pod_and_leaves_the_running_pods_alone(control_plane, k8s_namespace,
                                                                           api, operator):
    name = "pool-grow"
    before = _start(api, name, 2, 1)
    _patch(control_plane, k8s_namespace, name, 3, 2)

    joiner = wait_for(lambda: api.get("pods", f"{name}-node-2"), 30, what="the joining pod")
    labels = joiner["metadata"]["labels"]
    assert (labels["distflow.io/attempt"], labels["distflow.io/pool"], labels["distflow.io/job-name"]) == \
        ("1", "rollout", name)
    env = {e["name"]: e.get("value") for e in joiner["spec"]["containers"][0]["env"]}
    assert (env["DISTFLOW_JOIN"], env["PET_NNODES"], env["PET_NODE_RANK"], env["DISTFLOW_ATTEMPT"]) == \
        ("1", "3", "2", "1")
    running_env = {e["name"]: e.get("value") for e in api.get("pods", f"{name}-node-0")["spec"]["containers"][0]["env"]}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (running_env["MASTER_ADDR"], running_env["MASTER_PORT"])
    assert _request(api, name) == {"numNodes": 3, "rolloutNodes": 2}
    assert "numNodes: 3" in api.get("configmaps", f"{name}-config")["data"]["spec.yaml"]

    assert_grown_in_place(api, name, before, attemptRolloutNodes=2)
    events = {e["reason"]: e["message"] for e in api.events(name)}
    assert "in place" in events["ResizeRequested"] and "in place from 2 to 3" in events["Resized"]
    assert "NodeFailed" not in events


def test_shrink_deletes_the_pod_that_left_with_exit_4_and_counts_no_restart(control_plane, k8s_namespace,
                                                                          api, operator):
    name = "pool-shrink"
    before = _start(api, name, 3, 2)
    _patch(control_plane, k8s_namespace, name, 2, 1)
    wait_for(lambda: _request(api, name) == {"numNodes": 2, "rolloutNodes": 1}, 30, what="in-place request")
    status = api.wait_phase(name, "Running", attemptNodes=3)
    assert status["resizing"]["inPlace"] is True and status["resizing"]["to"] == 2
    assert len(api.live_pods(name, attempt=1, phase="Running")) == 3

    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-2", "Failed", exit_code=4)
    wait_for(lambda: f"{name}-node-2" not in _uids(api, name), 30, what="the leaving pod deleted")
    status = api.wait_phase(name, "Running", attemptNodes=2, attemptRolloutNodes=1)
    assert (status["attempt"], status["restarts"], status["disruptions"]) == (1, 0, 0)
    assert "lastFailure" not in status and status["lastResize"]["inPlace"] is True
    assert _uids(api, name) == {k: v for k, v in before.items() if k != f"{name}-node-2"}
    assert "NodeFailed" not in {e["reason"] for e in api.events(name)}


def test_exit_4_without_a_shrink_is_a_failure(control_plane, k8s_namespace, api, operator):
    name = "pool-exit4"
    _start(api, name, 2, 1)
    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-1", "Failed", exit_code=4)
    api.wait_running_gang(name, attempt=2, num_nodes=2, timeout_s=60)
    status = api.status(name)
    assert status["restarts"] == 1 and status["lastFailure"]["exitCode"] == 4


def test_a_trainer_count_change_is_a_whole_gang_resize(control_plane, k8s_namespace, api, operator):
    name = "pool-trainers"
    _start(api, name, 2, 1)
    _patch(control_plane, k8s_namespace, name, 3, 1)
    wait_for(lambda: _request(api, name) == {"numNodes": 3}, 30, what="whole-gang request")
    status = api.wait_phase(name, "Running", attemptNodes=2, desiredNodes=3)
    assert status["resizing"]["to"] == 3 and "inPlace" not in status["resizing"]
    assert api.get("pods", f"{name}-node-2") is None


def test_sizes_out_of_bounds_or_not_dividing_the_batch_and_other_async_edits_are_refused(
        control_plane, k8s_namespace, api, operator):
    name = "pool-refused"
    doc = pool_job(name, 2, 1)
    doc["spec"]["cluster"]["maxNodes"] = 4
    code, body = api.create_job(doc)
    assert code == 201, body
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.wait_running_gang(name, 1, 2)}
    # trainBatchSize 4 over 3 rollout nodes; above maxNodes; under one rollout node.
    for (nodes, rollout), reason in [((4, 3), "data.trainBatchSize"), ((5, 4), "cluster.maxNodes"),
                                     ((1, 0), "async.rolloutPool.numNodes")]:
        patch = {"spec": {"cluster": {"numNodes": nodes}, "async": {"rolloutPool": {"numNodes": rollout}}}}
        code, body = api.patch_job(name, patch)
        assert code == 422 and reason in body["message"], (nodes, rollout, body)
    code, body = api.patch_job(name, {"spec": {"async": {"maxStaleness": 3}}})
    assert code == 422 and "only async.rolloutPool.numNodes may" in body["message"], body
    code, body = api.patch_job(name, {"spec": {"async": {"rolloutPool": {"nodeSelector": {"a": "b"}}}}})
    assert code == 422 and "only async.rolloutPool.numNodes may" in body["message"], body
    job = api.job(name)
    assert (job["spec"]["cluster"]["numNodes"], job["spec"]["async"]["rolloutPool"]["numNodes"]) == (2, 1)
    assert _uids(api, name) == before and api.status(name)["phase"] == "Running"
