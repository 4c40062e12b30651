"""An asynchronous RLPostTrainJob (async.enable) on the real API server: two pools of node pods with
consistent ranks and pool labels, the rollout pool's own resources and placement, one PodGroup per
pool, status.pools, a gang restart from a pod of either pool, and bad pool specs rejected."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, operator, operator_kubeconfig_path, wait_for,
)

pytestmark = pytest.mark.operator

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob-async.yaml"
# scheduler-plugins' PodGroup kind, served for the test only (no coscheduling scheduler runs here).
POD_GROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.x-k8s.io"},
    "spec": {"group": "scheduling.x-k8s.io", "scope": "Namespaced",
             "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup", "listKind": "PodGroupList"},
             "versions": [{"name": "v1alpha1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def async_job(name: str, **spec_updates) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(copy.deepcopy(spec_updates))
    return doc


@pytest.fixture
def pod_group_kind(control_plane, crd):
    control_plane.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", POD_GROUP_CRD,
                          expect=(201, 409))
    wait_for(lambda: control_plane.kubectl("wait", "--for=condition=Established", "--timeout=20s",
                                           "crd/podgroups.scheduling.x-k8s.io").returncode == 0, 30,
             what="PodGroup CRD Established")
    yield
    control_plane.request("DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                          "podgroups.scheduling.x-k8s.io", expect=(200, 404))


def test_two_pool_job_gets_pool_pods_pod_groups_status_and_restarts_from_either_pool(
        control_plane, k8s_namespace, api, pod_group_kind, operator):
    rollout_node = control_plane.node_names[-1]
    doc = async_job("pools", scheduling={"batchScheduler": "scheduler-plugins",
                                         "schedulerName": "default-scheduler"})  # kube-scheduler binds here
    doc["spec"]["async"]["rolloutPool"]["nodeSelector"] = {"kubernetes.io/hostname": rollout_node}
    status, body = api.create_job(doc)
    assert status == 201, body

    pods = api.wait_running_gang("pools", attempt=1, num_nodes=3, timeout_s=120)  # a loaded scheduler
    for rank, pod in enumerate(pods):
        labels = pod["metadata"]["labels"]
        pool = "trainer" if rank < 2 else "rollout"
        assert pod["metadata"]["name"] == f"pools-node-{rank}"
        assert (labels["distflow.io/node-rank"], labels["distflow.io/pool"]) == (str(rank), pool)
        assert labels["scheduling.x-k8s.io/pod-group"] == f"pools-{pool}"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["WORLD_SIZE"]) == ("3", str(rank), "3")
    rollout = pods[2]["spec"]
    assert rollout["nodeName"] == rollout_node and rollout["nodeSelector"] == {"kubernetes.io/hostname": rollout_node}
    assert rollout["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert pods[0]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "2Gi",
                                                                         "nvidia.com/gpu": "1"}
    assert "nodeSelector" not in pods[0]["spec"]

    _, groups = control_plane.request(
        "GET", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{k8s_namespace}/podgroups", expect=(200,))
    assert sorted((g["metadata"]["name"], g["spec"]["minMember"], g["spec"]["minResources"]["nvidia.com/gpu"])
                  for g in groups["items"]) == [("pools-rollout", 1, "1"), ("pools-trainer", 2, "2")]

    status = wait_for(lambda: (s := api.status("pools")).get("readyNodes") == 3 and s, 120, what="3 ready")
    assert status["pools"] == [{"name": "trainer", "nodes": 2, "ready": 2}, {"name": "rollout", "nodes": 1, "ready": 1}]

    # Deleting the rollout pod restarts the whole gang; then a trainer pod does it again.
    for attempt, victim in ((2, "pools-node-2"), (3, "pools-node-0")):
        before = {p["metadata"]["uid"] for p in api.live_pods("pools")}
        control_plane.request("DELETE", f"/api/v1/namespaces/{k8s_namespace}/pods/{victim}", expect=(200,))
        again = api.wait_running_gang("pools", attempt=attempt, num_nodes=3, timeout_s=60)
        assert before.isdisjoint(p["metadata"]["uid"] for p in again)
        assert [p["metadata"]["labels"]["distflow.io/pool"] for p in again] == ["trainer", "trainer", "rollout"]
        assert api.wait_phase("pools", "Running", attempt=attempt, timeout_s=30)["restarts"] == attempt - 1


@pytest.mark.parametrize("rollout_nodes", [3, 4])
def test_a_rollout_pool_that_leaves_no_trainer_is_rejected_by_the_api_server(control_plane, k8s_namespace, api,
                                                                             crd, rollout_nodes):
    doc = async_job(f"nopool-{rollout_nodes}")
    doc["spec"]["async"]["rolloutPool"]["numNodes"] = rollout_nodes
    status, body = api.create_job(doc)
    assert status == 422, body
    assert "async.rolloutPool.numNodes: leaves no node to train; use fewer than cluster.numNodes" in body["message"]
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=json.dumps(doc))
    assert out.returncode != 0 and "spec.async.rolloutPool.numNodes" in out.stderr


def test_bad_pool_fields_are_rejected_or_fail_the_job_with_a_reason(api, operator):
    status, body = api.create_job(_with_pool("zero", numNodes=0))
    assert status == 422 and "spec.async.rolloutPool.numNodes" in body["message"], body
    status, body = api.create_job(_with_pool("gpus", resources={"limits": {"nvidia.com/gpu": "2"}}))
    assert status == 201, body
    failed = api.wait_phase("gpus", "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "spec.async.rolloutPool.resources.limits.nvidia.com/gpu" in failed["message"]
    assert not api.pods("gpus")
    assert api.create_job(async_job("fixed", runPolicy={"suspend": True}))[0] == 201
    status, body = api.patch_job("fixed", {"spec": {"async": {"maxStaleness": 3}}})
    assert status == 422 and "spec.async cannot change while the job exists" in body["message"]


def _with_pool(name: str, **pool) -> dict:
    doc = async_job(name)
    doc["spec"]["async"]["rolloutPool"].update(pool)
    return doc
