"""`kubectl scale rljob`: the CRD's scale subresource on the real API server (spec replicas =
``cluster.numNodes``, status replicas and selector from the operator). Sizes out of
``cluster.minNodes``/``cluster.maxNodes`` or not dividing the batch are refused with the
field's reason and the running job keeps its size. A size that is accepted resizes a synchronous
job in place: a grow creates the new ranks' pods in the running attempt (``DISTFLOW_JOIN=1``), a
shrink's leaving rank exits 4 and its pod is deleted (the exit is played here by a status patch,
as kwok runs no container); the other pods keep their uids and nothing is counted. A worker image
that stops instead (exit 3) restarts the gang at the new size without counting a restart."""

from __future__ import annotations

import json

import pytest

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path, wait_for,
)
from tests.operator.test_operator_pool_resize import assert_grown_in_place

pytestmark = pytest.mark.operator


def test_scale_subresource_reports_the_gang_and_refuses_sizes_out_of_bounds(control_plane, k8s_namespace, api,
                                                                            operator):
    name = "grpo-scale"
    code, body = api.create_job(example_job(name, cluster={"numNodes": 2, "minNodes": 2, "maxNodes": 4}))
    assert code == 201, body
    api.wait_running_gang(name, attempt=1, num_nodes=2)
    status = api.wait_phase(name, "Running", replicas=2)
    assert status["selector"] == f"app.kubernetes.io/managed-by=distflow-operator,distflow.io/job-name={name}"

    scale = f"{api.jobs}/{name}/scale"
    code, body = control_plane.request("GET", scale)
    assert code == 200, body
    assert (body["kind"], body["spec"]["replicas"], body["status"]["replicas"], body["status"]["selector"]) == \
        ("Scale", 2, 2, status["selector"])

    # trainBatchSize 4 over 3 rollout dp ranks; below minNodes; above maxNodes.
    for replicas, reason in [(3, "data.trainBatchSize"), (1, "cluster.minNodes"), (5, "cluster.maxNodes")]:
        out = control_plane.kubectl("scale", "-n", k8s_namespace, "rljob", name, f"--replicas={replicas}")
        assert out.returncode != 0 and reason in out.stderr, (replicas, out.stderr)
        assert api.job(name)["spec"]["cluster"]["numNodes"] == 2
    assert api.status(name)["phase"] == "Running" and len(api.live_pods(name, attempt=1)) == 2

    # A size within the bounds is the one change spec.cluster accepts; its other fields stay fixed.
    code, body = api.patch_job(name, {"spec": {"cluster": {"procsPerNode": 2}}})
    assert code == 422 and "only cluster.numNodes may" in body["message"], body
    code, body = control_plane.request("PATCH", scale, {"spec": {"replicas": 4}},
                                       content_type="application/merge-patch+json")
    assert code == 200 and body["spec"]["replicas"] == 4, body
    assert api.job(name)["spec"]["cluster"]["numNodes"] == 4


def _config_data(api, name):
    return (api.get("configmaps", f"{name}-config") or {}).get("data") or {}


def _request(api, name) -> dict | None:
    data = _config_data(api, name)
    return json.loads(data["resize"]) if "resize" in data else None


def _uids(api, name) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.live_pods(name)}


def _start(api, name) -> dict[str, str]:
    job = example_job(name, data={"trainBatchSize": 12}, cluster={"numNodes": 2, "maxNodes": 4})
    code, body = api.create_job(job)
    assert code == 201, body
    pods = api.wait_running_gang(name, attempt=1, num_nodes=2)
    api.wait_phase(name, "Running", attemptNodes=2)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


def _scale(control_plane, k8s_namespace, name, replicas):
    out = control_plane.kubectl("scale", "-n", k8s_namespace, "rljob", name, f"--replicas={replicas}")
    assert out.returncode == 0, out.stderr


def test_kubectl_scale_grows_a_sync_gang_in_place_and_shrinks_it_back(control_plane, k8s_namespace, api, operator):
    name = "grpo-resize"
    before = _start(api, name)

    _scale(control_plane, k8s_namespace, name, 3)
    joiner = wait_for(lambda: api.get("pods", f"{name}-node-2"), 30, what="the joining pod")
    assert joiner["metadata"]["labels"]["distflow.io/attempt"] == "1"
    env = {e["name"]: e.get("value") for e in joiner["spec"]["containers"][0]["env"]}
    assert (env["DISTFLOW_JOIN"], env["PET_NNODES"], env["PET_NODE_RANK"], env["DISTFLOW_ATTEMPT"]) == \
        ("1", "3", "2", "1")
    # The request and the spec at the new size, in the ConfigMap the pods see as /etc/distflow.
    assert _request(api, name) == {"numNodes": 3, "inPlace": True}
    assert "numNodes: 3" in _config_data(api, name)["spec.yaml"]

    assert_grown_in_place(api, name, before)
    assert _request(api, name) == {"numNodes": 3, "inPlace": True}  # kept for a rank that reads it late
    events = {e["reason"]: e["message"] for e in api.events(name)}
    assert "the gang resizes in place" in events["ResizeRequested"]
    assert "gang resized in place from 2 to 3 nodes" in events["Resized"]
    created = [e["message"] for e in api.events(name) if e["reason"] == "CreatedNodePods"]
    assert "created 1 node pods for attempt 1, joining its running gang (an in-place resize)" in created

    _scale(control_plane, k8s_namespace, name, 2)
    wait_for(lambda: _request(api, name) == {"numNodes": 2, "inPlace": True}, 30, what="the shrink's request")
    status = api.wait_phase(name, "Running", attemptNodes=3, desiredNodes=2)
    assert status["resizing"]["inPlace"] is True and status["resizing"]["to"] == 2
    assert len(api.live_pods(name, attempt=1, phase="Running")) == 3
    # Rank 2 leaves at a step boundary: exit 4; its pod is deleted, nothing restarts.
    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-2", "Failed", exit_code=4)
    wait_for(lambda: f"{name}-node-2" not in _uids(api, name), 30, what="the leaving pod deleted")
    status = api.wait_phase(name, "Running", attemptNodes=2)
    assert (status["attempt"], status["restarts"], status["disruptions"], status["replicas"]) == (1, 0, 0, 2)
    assert "lastFailure" not in status and "resizing" not in status
    assert (status["lastResize"]["from"], status["lastResize"]["to"], status["lastResize"]["inPlace"]) == (3, 2, True)
    assert _uids(api, name) == before
    assert not {"NodeFailed", "NodeLost"} & {e["reason"] for e in api.events(name)}


def test_a_worker_image_that_stops_with_exit_3_restarts_the_gang_at_the_new_size(control_plane, k8s_namespace,
                                                                                api, operator):
    name = "grpo-resize-stop"
    _start(api, name)
    _scale(control_plane, k8s_namespace, name, 3)
    wait_for(lambda: _request(api, name) == {"numNodes": 3, "inPlace": True}, 30, what="the in-place request")
    # An image without in-place resize reads a size other than its own and stops at a step boundary.
    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-1", "Failed", exit_code=3)
    pods = api.wait_running_gang(name, attempt=2, num_nodes=3, timeout_s=60)
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_NNODES"] == "3" and "DISTFLOW_JOIN" not in env, env
    status = api.wait_phase(name, "Running", attempt=2, attemptNodes=3, timeout_s=30)
    assert (status["restarts"], status["disruptions"], status["desiredNodes"], status["replicas"]) == (0, 0, 3, 3)
    assert "resizing" not in status and "lastFailure" not in status
    done = status["lastResize"]
    assert (done["from"], done["to"], done["attempt"]) == (2, 3, 2) and "inPlace" not in done
    assert done["requestedAt"] <= done["stoppedAt"] <= done["resumedAt"] and done["costSeconds"] >= 0
    data = _config_data(api, name)
    assert "resize" not in data and "numNodes: 3" in data["spec.yaml"]
    resized = [e["message"] for e in api.events(name) if e["reason"] == "Resized"]
    assert any("resized from 2 to 3 nodes (attempt 2)" in m for m in resized), resized
    assert not {"NodeFailed", "NodeLost"} & {e["reason"] for e in api.events(name)}


def test_a_gang_not_yet_running_is_replaced_at_the_new_size(control_plane, k8s_namespace, api, operator):
    name = "grpo-resize-pending"
    # No node has this label: the pods stay Pending, the gang never runs.
    job = example_job(name, data={"trainBatchSize": 12}, cluster={"numNodes": 2, "maxNodes": 4},
                      template={**example_job()["spec"]["template"], "nodeSelector": {"distflow.io/none": "x"}})
    code, body = api.create_job(job)
    assert code == 201, body
    wait_for(lambda: len(api.live_pods(name, attempt=1)) == 2, 30, what="attempt 1's pods")
    code, body = api.patch_job(name, {"spec": {"cluster": {"numNodes": 3}}})
    assert code == 200, body
    wait_for(lambda: len(api.live_pods(name, attempt=2)) == 3, 30,
             what=lambda: f"attempt 2 at 3 nodes (now {api.pod_summary(name)})")
    status = api.status(name)
    assert (status["restarts"], status["disruptions"], status["resizing"]["to"]) == (0, 0, 3)
    assert "resize" not in _config_data(api, name)
