"""`kubectl scale rljob`: the CRD's scale subresource on the real API server (spec replicas =
``cluster.numNodes``, status replicas and selector from the operator). Sizes out of
``cluster.minNodes``/``cluster.maxNodes`` or not dividing the batch are refused with the
field's reason and the running job keeps its size. A size that is accepted resizes the job:
the running gang is asked to stop (the workers' exit 3 is played here by status patches) and
restarts at the new size without counting a restart."""

from __future__ import annotations

import pytest

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path, wait_for,
)

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


def test_kubectl_scale_stops_the_gang_at_a_step_boundary_and_restarts_it_at_the_new_size(control_plane,
                                                                                       k8s_namespace, api,
                                                                                       operator):
    name = "grpo-resize"
    job = example_job(name, data={"trainBatchSize": 12}, cluster={"numNodes": 2, "maxNodes": 4})
    code, body = api.create_job(job)
    assert code == 201, body
    api.wait_running_gang(name, attempt=1, num_nodes=2)
    api.wait_phase(name, "Running", attemptNodes=2)

    out = control_plane.kubectl("scale", "-n", k8s_namespace, "rljob", name, "--replicas=3")
    assert out.returncode == 0, out.stderr
    # The running gang is asked to stop (the ConfigMap key its pods see as /etc/distflow/resize) and
    # keeps running at its size meanwhile.
    wait_for(lambda: _config_data(api, name).get("resize") == '{"numNodes": 3}', 30, what="resize request")
    status = api.wait_phase(name, "Running", attemptNodes=2, desiredNodes=3)
    assert (status["resizing"]["from"], status["resizing"]["to"]) == (2, 3) and "stoppedAt" not in status["resizing"]
    assert len(api.live_pods(name, attempt=1, phase="Running")) == 2

    # The workers stop at a step boundary: the first exits 3, the other follows.
    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-1", "Failed", exit_code=3)
    control_plane.set_pod_phase(k8s_namespace, f"{name}-node-0", "Failed", exit_code=3)
    pods = api.wait_running_gang(name, attempt=2, num_nodes=3, timeout_s=60)
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_NNODES"] == "3", env
    status = api.wait_phase(name, "Running", attempt=2, attemptNodes=3, timeout_s=30)
    assert (status["restarts"], status["disruptions"], status["desiredNodes"], status["replicas"]) == (0, 0, 3, 3)
    assert "resizing" not in status and "lastFailure" not in status
    done = status["lastResize"]
    assert (done["from"], done["to"], done["attempt"]) == (2, 3, 2)
    assert done["requestedAt"] <= done["stoppedAt"] <= done["resumedAt"] and done["costSeconds"] >= 0
    data = _config_data(api, name)
    assert "resize" not in data and "numNodes: 3" in data["spec.yaml"]
    events = {e["reason"]: e for e in api.events(name)}
    assert "cluster.numNodes 2 -> 3" in events["ResizeRequested"]["message"]
    assert events["Resized"]["type"] == "Normal" and "resized from 2 to 3 nodes" in events["Resized"]["message"]
    assert "NodeFailed" not in events


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
