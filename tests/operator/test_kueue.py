"""Kueue admits a job's node pods as one gang, on the real API server with a real Kueue.

A job labelled ``kueue.x-k8s.io/queue-name`` gets pods that Kueue's own
webhook gates; Kueue's controller admits the pod group (one Workload per gang
attempt) only when the whole gang fits the ClusterQueue's quota, and then
ungates every pod together. A gang restart queues the next attempt as a new
Workload after the failed one released its quota.

Kueue is built from its Go module by tests/controlplane/build_kueue.sh (cached,
optional); without the binary these tests skip, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.controlplane.cluster import ControlPlaneError
from tests.controlplane.kueue import KUEUE_NAMESPACE_LABEL, Kueue, build_kueue
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path, wait_for,
)

pytestmark = pytest.mark.operator

KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
GATE = "kueue.x-k8s.io/admission"
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def kueue(control_plane):
    prebuilt = os.environ.get("DISTFLOW_KUEUE_BIN")
    try:
        binary = Path(prebuilt) if prebuilt else build_kueue()
    except (ControlPlaneError, OSError) as err:
        pytest.skip(f"kueue binary missing: tests/controlplane/build_kueue.sh failed: {err}")
    if not os.access(binary, os.X_OK):
        pytest.skip(f"kueue binary missing at {binary} (tests/controlplane/build_kueue.sh builds it)")
    with Kueue(binary, control_plane) as running:
        yield running


@pytest.fixture
def queue(control_plane, kueue, k8s_namespace) -> str:
    """LocalQueue "lq" in a namespace Kueue manages, backed by a ClusterQueue of GPUS_PER_NODE GPUs."""
    key, value = KUEUE_NAMESPACE_LABEL
    control_plane.request("PATCH", f"/api/v1/namespaces/{k8s_namespace}", {"metadata": {"labels": {key: value}}},
                          content_type="application/merge-patch+json", expect=(200,))
    control_plane.request("POST", f"{KUEUE_API}/resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default"}},
        expect=(201, 409))
    quota = [{"name": "cpu", "nominalQuota": "64"}, {"name": "memory", "nominalQuota": "256Gi"},
             {"name": "nvidia.com/gpu", "nominalQuota": str(GPUS_PER_NODE)}]
    control_plane.request("POST", f"{KUEUE_API}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": k8s_namespace},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": "default", "resources": quota}]}]}}, expect=(201,))
    control_plane.request("POST", f"{KUEUE_API}/namespaces/{k8s_namespace}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
        "spec": {"clusterQueue": k8s_namespace}}, expect=(201,))
    yield "lq"
    control_plane.request("DELETE", f"{KUEUE_API}/clusterqueues/{k8s_namespace}")


def set_gpu_quota(control_plane, cluster_queue: str, gpus: int) -> None:
    _, cq = control_plane.request("GET", f"{KUEUE_API}/clusterqueues/{cluster_queue}", expect=(200,))
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2]["nominalQuota"] = str(gpus)
    control_plane.request("PUT", f"{KUEUE_API}/clusterqueues/{cluster_queue}", cq, expect=(200,))


def workload(control_plane, namespace: str, name: str) -> dict | None:
    status, body = control_plane.request("GET", f"{KUEUE_API}/namespaces/{namespace}/workloads/{name}")
    return body if status == 200 else None


def condition(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def gated(pod: dict) -> bool:
    return GATE in [g["name"] for g in pod["spec"].get("schedulingGates", [])]


def kueue_job(name: str, queue: str) -> dict:
    doc = example_job(name, cluster={"acceleratorsPerNode": GPUS_PER_NODE},
                      runPolicy={"maxRestarts": 2, "backoffSeconds": 0})
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue}
    return doc


def test_gang_waits_for_quota_for_all_its_pods_then_starts_together(control_plane, k8s_namespace, api, queue,
                                                                      operator):
    # Quota for one node pod: Kueue must hold both (one Workload for the pod group), not start one.
    status, body = api.create_job(kueue_job("kq", queue))
    assert status == 201, body
    pods = wait_for(lambda: len(p := api.live_pods("kq")) == 2 and p, 30, what="2 node pods")
    for pod in pods:
        assert gated(pod), pod["spec"]  # Kueue's webhook gated it at creation
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/managed"] == "true"
    held = wait_for(lambda: condition(w := workload(control_plane, k8s_namespace, "kq-a1"), "QuotaReserved")
                    .get("status") == "False" and w, 60, what="Workload kq-a1 pending for quota")
    assert [ps["count"] for ps in held["spec"]["podSets"]] == [2]
    message = condition(held, "QuotaReserved")["message"]
    assert "insufficient" in message and "nvidia.com/gpu" in message, message
    assert all(gated(p) and not p["spec"].get("nodeName") for p in api.live_pods("kq"))
    assert api.status("kq").get("phase") != "Running"

    set_gpu_quota(control_plane, k8s_namespace, 2 * GPUS_PER_NODE)
    wait_for(lambda: condition(workload(control_plane, k8s_namespace, "kq-a1"), "Admitted").get("status") == "True",
             60, what="Workload kq-a1 admitted")
    running = api.wait_running_gang("kq", attempt=1, num_nodes=2, timeout_s=60)
    assert not any(gated(p) for p in running)
    assert api.wait_phase("kq", "Running")["nodes"] == "2/2"


def kubelet_stops_deleted_pods(control_plane, api, namespace: str, job: str, attempt: int) -> None:
    """What a kubelet does with a running pod that is deleted: stop its container and report the pod
    Failed. Kueue holds the pod (finalizer kueue.x-k8s.io/managed), and its quota, until then; kwok
    finishes the deletion only of pods without finalizers, so this test plays the kubelet."""
    def deleted():
        pods = [p for p in api.pods(job) if p["metadata"]["labels"]["distflow.io/attempt"] == str(attempt)]
        return pods if pods and all(p["metadata"].get("deletionTimestamp") for p in pods) else None
    for pod in wait_for(deleted, 60, what=f"{job} attempt {attempt} deleted"):
        if pod["status"].get("phase") not in ("Succeeded", "Failed"):
            control_plane.set_pod_phase(namespace, pod["metadata"]["name"], "Failed", exit_code=137)
    wait_for(lambda: not [p for p in api.pods(job) if p["metadata"]["labels"]["distflow.io/attempt"] == str(attempt)],
             60, what=f"{job} attempt {attempt} gone")


def test_a_gang_restart_while_the_quota_is_full_waits_and_resumes_when_admitted(
        control_plane, k8s_namespace, api, queue, operator):
    set_gpu_quota(control_plane, k8s_namespace, 2 * GPUS_PER_NODE)
    assert api.create_job(kueue_job("kr", queue))[0] == 201
    api.wait_running_gang("kr", attempt=1, num_nodes=2, timeout_s=90)
    # Other work takes half the quota while kr runs (Kueue does not evict an admitted Workload for it).
    set_gpu_quota(control_plane, k8s_namespace, GPUS_PER_NODE)
    control_plane.set_pod_phase(k8s_namespace, "kr-node-1", "Failed", exit_code=1)
    kubelet_stops_deleted_pods(control_plane, api, k8s_namespace, "kr", attempt=1)
    # The restart's pods are created gated; their Workload waits for quota for the whole gang.
    waiting = wait_for(lambda: len(p := api.live_pods("kr", attempt=2)) == 2 and p, 60, what="kr attempt 2 created")
    assert all(gated(p) for p in waiting)
    held = wait_for(lambda: condition(w := workload(control_plane, k8s_namespace, "kr-a2"), "QuotaReserved")
                    .get("status") == "False" and w, 60, what="Workload kr-a2 pending for quota")
    assert "insufficient" in condition(held, "QuotaReserved")["message"]
    assert workload(control_plane, k8s_namespace, "kr-a1") is None or condition(
        workload(control_plane, k8s_namespace, "kr-a1"), "Finished").get("status") == "True"
    status = api.status("kr")
    assert (status["phase"], status["attempt"], status["restarts"]) == ("Restarting", 2, 1), status
    # Room again: the restart is admitted whole and runs to the end.
    set_gpu_quota(control_plane, k8s_namespace, 2 * GPUS_PER_NODE)
    pods = api.wait_running_gang("kr", attempt=2, num_nodes=2, timeout_s=90)
    assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in pods} == {"kr-a2"}
    assert condition(workload(control_plane, k8s_namespace, "kr-a2"), "Admitted").get("status") == "True"
    for pod in pods:
        control_plane.set_pod_phase(k8s_namespace, pod["metadata"]["name"], "Succeeded")
    assert api.wait_phase("kr", "Succeeded", timeout_s=60)["restarts"] == 1


@pytest.fixture
def priorities(control_plane, k8s_namespace):
    """PriorityClasses "<ns>-low" (10) and "<ns>-high" (1000); Kueue takes a Workload's priority from its pods'."""
    names = {level: f"{k8s_namespace}-{level}"[:63] for level in ("low", "high")}
    for level, value in (("low", 10), ("high", 1000)):
        control_plane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", {
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": names[level]},
            "value": value}, expect=(201,))
    yield names
    for name in names.values():
        control_plane.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")


def test_a_gang_preempted_by_a_higher_priority_workload_is_readmitted_without_using_up_max_restarts(
        control_plane, k8s_namespace, api, queue, operator, priorities):
    set_gpu_quota(control_plane, k8s_namespace, 2 * GPUS_PER_NODE)
    control_plane.request("PATCH", f"{KUEUE_API}/clusterqueues/{k8s_namespace}",
                          {"spec": {"preemption": {"withinClusterQueue": "LowerPriority"}}},
                          content_type="application/merge-patch+json", expect=(200,))
    low = kueue_job("kl", queue)
    low["spec"]["runPolicy"]["maxRestarts"] = 0  # a preemption that counted would fail the job
    low["spec"]["scheduling"] = {"priorityClassName": priorities["low"]}
    assert api.create_job(low)[0] == 201
    api.wait_running_gang("kl", attempt=1, num_nodes=2, timeout_s=90)
    high = kueue_job("kh", queue)
    high["spec"]["scheduling"] = {"priorityClassName": priorities["high"]}
    assert api.create_job(high)[0] == 201
    # Kueue evicts kl's Workload: its pods get TerminationTarget and are deleted; kh takes the quota.
    restarted = api.wait_phase("kl", "Restarting", attempt=2, timeout_s=60)
    kubelet_stops_deleted_pods(control_plane, api, k8s_namespace, "kl", attempt=1)
    api.wait_running_gang("kh", attempt=1, num_nodes=2, timeout_s=90)
    # The phase's reason moves on to WaitingForTermination while Kueue holds the pods; lastFailure stays.
    assert (restarted["restarts"], restarted["disruptions"]) == (0, 1), restarted
    assert (restarted["lastFailure"]["attempt"], restarted["lastFailure"]["reason"]) == (1, "NodeDisrupted")
    wait_for(lambda: len(p := api.live_pods("kl", attempt=2)) == 2 and all(gated(x) for x in p), 60,
             what="kl attempt 2 gated behind kh")
    for rank in (0, 1):
        control_plane.set_pod_phase(k8s_namespace, f"kh-node-{rank}", "Succeeded")
    api.wait_phase("kh", "Succeeded", timeout_s=60)
    api.wait_running_gang("kl", attempt=2, num_nodes=2, timeout_s=90)
    status = api.wait_phase("kl", "Running", attempt=2)
    assert (status["restarts"], status["disruptions"]) == (0, 1), status
