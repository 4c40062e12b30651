"""Faults and upgrades on a real API server: version skew between operator and CRD,
observations that survive relists, transient pod errors, disruptions, RBAC."""

from __future__ import annotations

import base64
import json
import time

import pytest
import yaml

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    CRD_FILE, api, crd, example_job, operator, operator_kubeconfig_path, operator_running, wait_for,
)

pytestmark = pytest.mark.operator


def _apply_crd(control_plane, doc) -> None:
    # JSON, not PyYAML's YAML: that writes the property `n` (spec.rollout.n) unquoted, which
    # kubectl's YAML 1.1 reads as the boolean false, so the CRD would lose the field.
    out = control_plane.kubectl("apply", "-f", "-", input=json.dumps(doc))
    assert out.returncode == 0, out.stderr


def _crd_with_new_defaulted_field() -> dict:
    """The checked-in CRD plus one defaulted field, as a newer release would add it."""
    doc = yaml.safe_load(CRD_FILE.read_text())
    props = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    props["runPolicy"]["properties"]["podReplacementPolicy"] = {"type": "string", "default": "Failed"}
    return doc


def _condition(status, ctype) -> dict:
    return {c["type"]: c for c in status.get("conditions") or []}.get(ctype) or {}


def test_newer_crd_never_fails_a_running_job_and_rollback_clears_the_condition(
        control_plane, k8s_namespace, api, operator_kubeconfig_path):
    with operator_running(operator_kubeconfig_path, k8s_namespace):
        api.create_job(example_job("skew", runPolicy={"backoffSeconds": 0}))
        before = api.wait_running_gang("skew", attempt=1, num_nodes=2)
        api.wait_phase("skew", "Running")
    try:
        _apply_crd(control_plane, _crd_with_new_defaulted_field())
        wait_for(lambda: (api.job("skew")["spec"]["runPolicy"].get("podReplacementPolicy") == "Failed"),
                 20, what="the new default served")
        with operator_running(operator_kubeconfig_path, k8s_namespace):  # this operator predates the field
            status = wait_for(lambda: _condition(s := api.status("skew"), "VersionSkew").get("status") == "True"
                              and s, 20, what="VersionSkew condition")
            assert status["phase"] == "Running"
            skew = _condition(status, "VersionSkew")
            assert skew["reason"] == "UnknownFields" and "spec.runPolicy.podReplacementPolicy" in skew["message"]
            assert [p["metadata"]["uid"] for p in api.live_pods("skew")] == [
                p["metadata"]["uid"] for p in before]
            assert "UnknownFields" in [e["reason"] for e in api.events("skew")]
            # Still managed: a failed node restarts the gang under the skewed operator.
            control_plane.set_pod_phase(k8s_namespace, "skew-node-1", "Failed", exit_code=1)
            api.wait_running_gang("skew", attempt=2, num_nodes=2)
            api.wait_phase("skew", "Running", attempt=2)
    finally:
        _apply_crd(control_plane, yaml.safe_load(CRD_FILE.read_text()))
    wait_for(lambda: "podReplacementPolicy" not in api.job("skew")["spec"]["runPolicy"], 20,
             what="rolled-back CRD prunes the field")
    with operator_running(operator_kubeconfig_path, k8s_namespace):
        api.patch_job("skew", {"metadata": {"annotations": {"touched": "1"}}})
        status = wait_for(lambda: _condition(s := api.status("skew"), "VersionSkew").get("status") == "False"
                          and s, 20, what="VersionSkew cleared")
        assert (status["phase"], status["attempt"], status["restarts"]) == ("Running", 2, 1)


def _delete_behind_the_api_servers_back(control_plane, namespace: str, pod: str) -> None:
    """Remove a pod straight from etcd and compact its history: no watch can replay the delete."""
    key = base64.b64encode(f"/registry/pods/{namespace}/{pod}".encode()).decode()
    assert control_plane.etcd("kv/deleterange", {"key": key}).get("deleted") == "1"
    revision = control_plane.etcd("kv/range", {"key": key})["header"]["revision"]
    control_plane.etcd("kv/compaction", {"revision": revision, "physical": True})


def test_pod_deleted_during_a_watch_gap_is_purged_by_the_relist_and_restarts_the_gang(
        control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("relist", runPolicy={"backoffSeconds": 0}))
    api.wait_running_gang("relist", attempt=1, num_nodes=2)
    api.wait_phase("relist", "Running")
    control_plane.restart_apiserver(
        while_down=lambda: _delete_behind_the_api_servers_back(control_plane, k8s_namespace, "relist-node-1"))
    assert [p["metadata"]["name"] for p in api.pods("relist")] == ["relist-node-0"]
    # The watch resumes with 410 Gone; only a LIST can tell the operator that node 1 is gone.
    api.wait_running_gang("relist", attempt=2, num_nodes=2, timeout_s=40)
    status = api.wait_phase("relist", "Running", attempt=2)
    assert status["restarts"] == 1 and "relist-node-1" in _condition(status, "Restarting").get("message", "") \
        or any("relist-node-1 was deleted" in e["message"] for e in api.events("relist"))


def test_pods_stuck_terminating_are_force_deleted_and_the_status_says_what_the_restart_waits_for(
        control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("stuck", runPolicy={"backoffSeconds": 0, "terminatingTimeoutSeconds": 0}))
    api.wait_running_gang("stuck", attempt=1, num_nodes=2)
    api.wait_phase("stuck", "Running")
    control_plane.stop_kwok()  # the kubelets are gone: deleted pods stay Terminating
    try:
        control_plane.set_pod_phase(k8s_namespace, "stuck-node-1", "Failed", exit_code=1)
        # node 0 (running, 30 s grace) stays Terminating: the status names it once the operator has seen it so.
        waiting = wait_for(lambda: (s := api.status("stuck")).get("reason") == "WaitingForTermination"
                           and "stuck-node-0" in s["message"] and s, 20, what=lambda: str(api.status("stuck")))
        assert waiting["phase"] == "Restarting" and "terminatingTimeoutSeconds=0" in waiting["message"]
        assert _condition(waiting, "Restarting")["reason"] == "WaitingForTermination"
        # Grace period (30 s) + terminatingTimeoutSeconds (0), then a force delete; attempt 2 is created.
        wait_for(lambda: {p["metadata"]["labels"]["distflow.io/attempt"] for p in api.pods("stuck")} == {"2"}
                 and len(api.pods("stuck")) == 2, 60, what="attempt 1 force-deleted, attempt 2 created")
    finally:
        control_plane.start_kwok()
    assert api.wait_phase("stuck", "Running", attempt=2, timeout_s=30)["restarts"] == 1


def _one_pod_quota(control_plane, api, namespace: str) -> None:
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one-pod"},
             "spec": {"hard": {"pods": "1"}}}
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/resourcequotas", quota, expect=(201,))
    wait_for(lambda: (api.get("resourcequotas", "one-pod") or {}).get("status", {}).get("hard"), 20,
             what="quota active")


def test_pod_creation_forbidden_by_quota_is_reported_then_fails_the_job_with_one_event(
        control_plane, k8s_namespace, api, operator):
    _one_pod_quota(control_plane, api, k8s_namespace)
    api.create_job(example_job("quota", runPolicy={"podErrorGraceSeconds": 4}))
    waiting = api.wait_phase("quota", "Pending", reason="PodCreationRejected", timeout_s=10)
    assert "exceeded quota" in waiting["message"] and "podErrorGraceSeconds=4" in waiting["message"]
    status = api.wait_phase("quota", "Failed", timeout_s=30)
    assert status["reason"] == "PodCreationRejected" and "exceeded quota" in status["message"]
    rejected = [e for e in api.events("quota") if e["reason"] == "PodCreationRejected"]
    # Every refusal has one message and makes one event; the job failing makes the other.
    assert len(rejected) == 2 and all("exceeded quota" in e["message"] for e in rejected)


@pytest.mark.parametrize("waiting, reason", [("ErrImagePull", "ImagePullFailed"),
                                             ("CreateContainerConfigError", "InvalidPodConfig")])
def test_pod_waiting_on_a_transient_error_fails_the_job_only_after_the_grace_period(
        control_plane, k8s_namespace, api, operator, waiting, reason):
    # No node matches, so no kubelet (kwok) touches the pods: the test writes what a kubelet writes
    # while it cannot pull the image or find the Secret the pod needs.
    api.create_job(example_job("stuck", runPolicy={"podErrorGraceSeconds": 8},
                               template={"nodeSelector": {"distflow.io/no-such-pool": "x"}}))
    pods = wait_for(lambda: len(p := api.live_pods("stuck")) == 2 and p, 30, what="2 node pods")
    created = time.monotonic()
    pod = pods[1]
    container = pod["spec"]["containers"][0]
    control_plane.request("PATCH", f"/api/v1/namespaces/{k8s_namespace}/pods/{pod['metadata']['name']}/status",
                          {"status": {"containerStatuses": [{
                              "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                              "restartCount": 0, "state": {"waiting": {"reason": waiting, "message": "not yet"}}}]}},
                          content_type="application/strategic-merge-patch+json", expect=(200,))
    time.sleep(3)
    assert api.status("stuck").get("phase") != "Failed", api.status("stuck")  # inside the grace period
    status = api.wait_phase("stuck", "Failed", timeout_s=30)
    assert time.monotonic() - created >= 6  # not before the grace period (8 s from the pod's creation)
    assert status["reason"] == reason and "podErrorGraceSeconds=8" in status["message"], status


def test_pod_refused_as_invalid_is_reported_then_fails_the_job_on_the_third_try(control_plane, k8s_namespace,
                                                                                api, operator):
    # A free-form volume the CRD cannot check: two sources in one volume, which pod validation refuses (422).
    bad_volume = {"name": "data", "emptyDir": {}, "configMap": {"name": "data"}}
    api.create_job(example_job("badvol", template={"volumes": [bad_volume]}))
    waiting = api.wait_phase("badvol", "Pending", reason="PodCreationRejected", timeout_s=10)
    assert "may not specify more than 1 volume type" in waiting["message"], waiting
    status = api.wait_phase("badvol", "Failed", timeout_s=30)
    assert status["reason"] == "PodCreationRejected" and "3 of 3 tries" in status["message"], status
    assert not api.pods("badvol")
    messages = [e["message"] for e in api.events("badvol") if e["reason"] == "PodCreationRejected"]
    # One event per distinct refusal (the API server names the pod it refused: one or two of them over
    # the three passes), then one for the failure; no refusal is repeated.
    assert len(set(messages)) == len(messages) and 2 <= len(messages) <= 3, messages
    assert sum("3 of 3 tries" in m for m in messages) == 1, messages


def test_job_forbidden_for_a_while_runs_once_the_quota_is_lifted(control_plane, k8s_namespace, api, operator):
    _one_pod_quota(control_plane, api, k8s_namespace)
    api.create_job(example_job("lifted"))
    api.wait_phase("lifted", "Pending", reason="PodCreationRejected", timeout_s=10)
    control_plane.request("DELETE", f"/api/v1/namespaces/{k8s_namespace}/resourcequotas/one-pod", expect=(200,))
    api.wait_running_gang("lifted", attempt=1, num_nodes=2)
    status = api.wait_phase("lifted", "Running")
    assert (status["attempt"], status["restarts"], status["nodes"]) == (1, 0, "2/2")


def test_eviction_restarts_the_gang_without_using_up_max_restarts(control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("evict", runPolicy={"maxRestarts": 0, "backoffSeconds": 0}))
    api.wait_running_gang("evict", attempt=1, num_nodes=2)
    api.wait_phase("evict", "Running")
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": "evict-node-1", "namespace": k8s_namespace}}
    control_plane.request("POST", f"/api/v1/namespaces/{k8s_namespace}/pods/evict-node-1/eviction", eviction,
                          expect=(201,))
    api.wait_running_gang("evict", attempt=2, num_nodes=2)
    status = api.wait_phase("evict", "Running", attempt=2)
    assert (status["restarts"], status["disruptions"]) == (0, 1)


def test_foreground_deletion_keeps_a_finished_jobs_phase(control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("done"))
    api.wait_running_gang("done", attempt=1, num_nodes=2)
    for rank in (0, 1):
        control_plane.set_pod_phase(k8s_namespace, f"done-node-{rank}", "Succeeded")
    api.wait_phase("done", "Succeeded")
    # A finalizer of the test's holds the job while the garbage collector removes its children.
    api.patch_job("done", {"metadata": {"finalizers": ["distflow.io/test-hold"]}})
    control_plane.request("DELETE", f"{api.jobs}/done", {"propagationPolicy": "Foreground"}, expect=(200, 202))
    try:
        wait_for(lambda: not api.pods("done"), 20, what="children deleted")
        time.sleep(2.0)  # the operator sees the deleting job and its pods vanish
        assert api.status("done")["phase"] == "Succeeded"
    finally:
        api.patch_job("done", {"metadata": {"finalizers": None}})
