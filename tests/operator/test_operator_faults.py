"""Faults and upgrades on a real API server: version skew between operator and CRD,
observations that survive relists, transient pod errors, disruptions, RBAC."""

from __future__ import annotations

import base64
import json
import re
import time

import pytest
import yaml

from distflow_operator.observed import parse_time
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    CRD_FILE, api, crd, example_job, operator, operator_kubeconfig_path, operator_running, wait_for,
)
from tests.previous_release import previous_spec_package

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
    # Node 1 of attempt 1 is gone (the operator may already have begun attempt 2 when this lists).
    assert "relist-node-1" not in [p["metadata"]["name"] for p in api.pods("relist")
                                   if p["metadata"]["labels"]["distflow.io/attempt"] == "1"]
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


def _tries(status) -> int:
    found = re.search(r"\((\d+) tries in", status.get("message") or "")
    return int(found.group(1)) if found else 0


def test_a_quota_refusal_holds_the_job_past_the_grace_and_it_runs_once_the_quota_has_room(
        control_plane, k8s_namespace, api, operator):
    _one_pod_quota(control_plane, api, k8s_namespace)
    api.create_job(example_job("quota", runPolicy={"podErrorGraceSeconds": 2}))
    waiting = api.wait_phase("quota", "Pending", reason="QuotaExceeded", timeout_s=15)
    assert "exceeded quota" in waiting["message"], waiting
    # Tries 2 s, then 4 s apart: the third is well past podErrorGraceSeconds=2, and the job still waits.
    held = wait_for(lambda: _tries(s := api.status("quota")) >= 3 and s, 30, what=lambda: str(api.status("quota")))
    assert (held["phase"], held["reason"]) == ("Pending", "QuotaExceeded"), held
    control_plane.request("DELETE", f"/api/v1/namespaces/{k8s_namespace}/resourcequotas/one-pod", expect=(200,))
    api.wait_running_gang("quota", attempt=1, num_nodes=2, timeout_s=90)
    status = api.wait_phase("quota", "Running")
    assert (status["attempt"], status["restarts"], status["nodes"]) == (1, 0, "2/2")


@pytest.mark.parametrize("waiting, reason", [("ErrImagePull", "ImagePullFailed"),
                                             ("CreateContainerConfigError", "InvalidPodConfig")])
def test_pod_waiting_on_a_transient_error_fails_the_job_only_after_the_grace_period(
        control_plane, k8s_namespace, api, operator, waiting, reason):
    # No node matches, so no kubelet (kwok) touches the pods: the test writes what a kubelet writes
    # while it cannot pull the image or find the Secret the pod needs.
    api.create_job(example_job("stuck", runPolicy={"podErrorGraceSeconds": 8},
                               template={"nodeSelector": {"distflow.io/no-such-pool": "x"}}))
    pods = wait_for(lambda: len(p := api.live_pods("stuck")) == 2 and p, 30, what="2 node pods")
    # The pods wait for a node longer than the grace (gated by Kueue, or GPUs an autoscaler adds) ...
    time.sleep(9)
    pod = pods[1]
    container = pod["spec"]["containers"][0]
    control_plane.request("PATCH", f"/api/v1/namespaces/{k8s_namespace}/pods/{pod['metadata']['name']}/status",
                          {"status": {"containerStatuses": [{
                              "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                              "restartCount": 0, "state": {"waiting": {"reason": waiting, "message": "not yet"}}}]}},
                          content_type="application/strategic-merge-patch+json", expect=(200,))
    errored = time.monotonic()  # ... then the pull fails: the grace runs from here
    seen = wait_for(lambda: (s := api.status("stuck")).get("podErrors") and s, 10, what="the error seen")
    assert [(e["pod"], e["reason"]) for e in seen["podErrors"]] == [(pod["metadata"]["name"], waiting)]
    time.sleep(3)
    assert api.status("stuck").get("phase") != "Failed", api.status("stuck")  # inside the grace period
    status = api.wait_phase("stuck", "Failed", timeout_s=30)
    assert time.monotonic() - errored >= 7  # not before the grace period (8 s from the error's first sight)
    assert status["reason"] == reason and "podErrorGraceSeconds=8" in status["message"], status


def test_pod_refused_as_invalid_is_reported_then_fails_the_job_on_the_third_try(control_plane, k8s_namespace,
                                                                                api, operator):
    # A free-form volume the CRD cannot check: two sources in one volume, which pod validation refuses (422).
    bad_volume = {"name": "data", "emptyDir": {}, "configMap": {"name": "data"}}
    api.create_job(example_job("badvol", template={"volumes": [bad_volume]}))
    seen: list[tuple[str, str]] = []

    def failure_event():
        # The statuses the job goes through, until the event of its failure.
        status = api.status("badvol")
        if status.get("reason") == "PodCreationRejected" and (not seen or seen[-1][1] != status["message"]):
            seen.append((status["phase"], status["message"]))
        return [e for e in api.events("badvol") if "3 of 3 tries" in e["message"]]
    failed = wait_for(failure_event, 60, interval_s=0.05, what=lambda: f"the failure's event (seen {seen})")
    tries = [next((t for t in ("1 of 3", "2 of 3", "3 of 3") if t in message), "") for _, message in seen]
    assert [phase for phase, _ in seen] == ["Pending", "Pending", "Failed"] and tries == ["1 of 3", "2 of 3", "3 of 3"]
    assert "may not specify more than 1 volume type" in seen[0][1], seen
    assert api.status("badvol")["reason"] == "PodCreationRejected" and not api.pods("badvol")
    events = [e for e in api.events("badvol") if e["reason"] == "PodCreationRejected"]
    # One event per distinct refusal (the API server names the pod it refused: one or two of them over
    # the three tries), then one for the failure; no refusal is repeated.
    messages = [e["message"] for e in events]
    assert len(set(messages)) == len(messages) and 2 <= len(messages) <= 3 and len(failed) == 1, messages
    # The tries are 2 s, then 4 s apart (the events carry whole seconds).
    first = min(parse_time(e.get("eventTime") or e["firstTimestamp"]) for e in events)
    assert (parse_time(failed[0]["firstTimestamp"]) - first).total_seconds() >= 5, events


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


def _stop_like_kueue(control_plane, namespace: str, pod: str) -> None:
    """What Kueue's pod integration does when it preempts an admitted workload: the TerminationTarget
    condition (sigs.k8s.io/kueue pkg/controller/jobs/pod), then a delete."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {"type": "TerminationTarget", "status": "True", "reason": "StoppedByKueue", "lastTransitionTime": now,
                 "message": "Preempted to accommodate a workload (UID: w-2) due to prioritization in the ClusterQueue"}
    base = f"/api/v1/namespaces/{namespace}/pods/{pod}"
    control_plane.request("PATCH", base + "/status", {"status": {"conditions": [condition]}},
                          content_type="application/strategic-merge-patch+json", expect=(200,))
    control_plane.request("DELETE", base, expect=(200, 202))


def test_the_fourth_kueue_preemption_does_not_fail_a_job_with_the_default_budget(
        control_plane, k8s_namespace, api, operator):
    job = example_job("preempt", runPolicy={"backoffSeconds": 1})
    del job["spec"]["runPolicy"]["maxRestarts"]  # the default budget: 3
    api.create_job(job)
    for attempt in range(1, 5):
        api.wait_running_gang("preempt", attempt=attempt, num_nodes=2, timeout_s=40)
        api.wait_phase("preempt", "Running", attempt=attempt)
        _stop_like_kueue(control_plane, k8s_namespace, "preempt-node-0")
    api.wait_running_gang("preempt", attempt=5, num_nodes=2, timeout_s=40)  # backoffs 1, 2, 4, 8 s
    status = api.wait_phase("preempt", "Running", attempt=5)
    assert (status["restarts"], status["disruptions"]) == (0, 4), status
    assert (status["lastFailure"]["attempt"], status["lastFailure"]["pod"]) == (4, "preempt-node-0"), status


def test_the_previous_release_reads_the_config_map_the_operator_writes(
        control_plane, k8s_namespace, api, operator, tmp_path):
    # The API server fills every CRD default into the stored job, new fields' included: the operator
    # must still render only what the job sets, or an older worker image exits 2 on the first one.
    api.create_job(example_job("older"))
    config = wait_for(lambda: api.get("configmaps", "older-config"), 30, what="the job's ConfigMap")
    path = tmp_path / "spec.yaml"
    path.write_text(config["data"]["spec.yaml"])
    older = previous_spec_package(tmp_path / "previous").load_job_spec(path)
    assert (older.cluster.num_nodes, older.trainer.total_steps, older.run_policy.max_restarts) == (2, 3, 2)
    assert older.template.image == "distflow/worker:0.1.0"


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
