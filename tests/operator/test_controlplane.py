"""The test control plane behaves like a cluster: GPU nodes, scheduling, pod
phases that stick, owner-reference garbage collection, RBAC."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = pytest.mark.operator


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Poll until predicate() is truthy; return its value or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met in {timeout_s} s: {predicate}")


def gpu_pod(name: str, gpus: int = 1) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox",
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_fake_nodes_are_ready_with_eight_gpus(control_plane):
    _, nodes = control_plane.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok", expect=(200,))
    by_name = {n["metadata"]["name"]: n for n in nodes["items"]}
    assert sorted(by_name) == sorted(control_plane.node_names)
    for node in by_name.values():
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["status"]["allocatable"]["cpu"] == "64"


def test_gpu_pod_is_scheduled_onto_kwok_node_and_runs(control_plane, k8s_namespace):
    base = f"/api/v1/namespaces/{k8s_namespace}/pods"
    control_plane.request("POST", base, gpu_pod("trainer"), expect=(201,))

    def running():
        pod = control_plane.request("GET", f"{base}/trainer", expect=(200,))[1]
        return pod if pod.get("status", {}).get("phase") == "Running" else None

    pod = wait_for(running)
    assert pod["spec"]["nodeName"] in control_plane.node_names


def test_a_component_that_exits_is_started_again_and_recorded(control_plane, k8s_namespace):
    # As a kubelet restarts a static pod: kube-scheduler exits by design on a corrupted cache.
    seen = len(control_plane.restarts)
    old_pid = control_plane.pid("kube-scheduler")
    os.kill(old_pid, signal.SIGKILL)
    gone = wait_for(lambda: control_plane.restarts[seen:], timeout_s=10)
    assert [(g.name, g.returncode) for g in gone] == [("kube-scheduler", -signal.SIGKILL)]
    assert control_plane.pid("kube-scheduler") != old_pid
    del control_plane.restarts[seen:]  # caused by this test: not an exit to report
    base = f"/api/v1/namespaces/{k8s_namespace}/pods"
    control_plane.request("POST", base, gpu_pod("after-restart"), expect=(201,))
    assert wait_for(lambda: control_plane.request("GET", f"{base}/after-restart")[1]["spec"].get("nodeName"))


def test_pod_phase_written_by_test_is_not_reverted_by_kwok(control_plane, k8s_namespace):
    base = f"/api/v1/namespaces/{k8s_namespace}/pods"
    control_plane.request("POST", base, gpu_pod("worker"), expect=(201,))
    wait_for(lambda: control_plane.request("GET", f"{base}/worker")[1]
             .get("status", {}).get("phase") == "Running")

    updated = control_plane.set_pod_phase(k8s_namespace, "worker", "Failed", exit_code=3)
    assert updated["status"]["phase"] == "Failed"
    time.sleep(3)  # several kwok reconcile rounds
    pod = control_plane.request("GET", f"{base}/worker", expect=(200,))[1]
    assert pod["status"]["phase"] == "Failed"
    terminated = pod["status"]["containerStatuses"][0]["state"]
    assert list(terminated) == ["terminated"]
    assert terminated["terminated"]["exitCode"] == 3


def test_kubectl_sees_the_cluster(control_plane):
    out = control_plane.kubectl("get", "nodes", "-l", "type=kwok", "-o", "name", check=True)
    assert sorted(out.stdout.split()) == sorted(f"node/{n}" for n in control_plane.node_names)


def test_dependent_of_deleted_owner_is_garbage_collected(control_plane, k8s_namespace):
    base = f"/api/v1/namespaces/{k8s_namespace}/configmaps"
    _, owner = control_plane.request("POST", base, {"metadata": {"name": "owner"}}, expect=(201,))
    child = {"metadata": {"name": "child", "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]}}
    control_plane.request("POST", base, child, expect=(201,))
    time.sleep(1)  # the collector must leave a dependent of a live owner alone
    assert control_plane.request("GET", f"{base}/child")[0] == 200

    control_plane.request("DELETE", f"{base}/owner", expect=(200,))
    wait_for(lambda: control_plane.request("GET", f"{base}/child")[0] == 404)


def test_serviceaccount_without_grants_is_forbidden_to_list_pods(control_plane, k8s_namespace):
    control_plane.request("POST", f"/api/v1/namespaces/{k8s_namespace}/serviceaccounts",
                          {"metadata": {"name": "nobody"}}, expect=(201,))
    token = control_plane.make_token_for_serviceaccount(k8s_namespace, "nobody")

    status, body = control_plane.request("GET", f"/api/v1/namespaces/{k8s_namespace}/pods",
                                         token=token)
    assert status == 403
    assert body["reason"] == "Forbidden"
    assert f"system:serviceaccount:{k8s_namespace}:nobody" in body["message"]
    whoami = control_plane.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                                   token=token, check=True)
    assert whoami.stdout == f"system:serviceaccount:{k8s_namespace}:nobody"


def test_python_client_lists_namespaces(control_plane, k8s_namespace):
    from kubernetes import client

    with control_plane.api_client() as api:
        names = {ns.metadata.name for ns in client.CoreV1Api(api).list_namespace().items}
    assert k8s_namespace in names
