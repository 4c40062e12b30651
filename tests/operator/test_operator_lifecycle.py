"""A job's life across names and watch gaps, on a real API server: a job re-created while its
predecessor's pods still hold their names, a child kind the cluster does not serve, and a job
deleted while the operator's watch was down."""

from __future__ import annotations

import base64
import time
import urllib.request

import pytest

from tests.controlplane.cluster import free_port
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path, operator_running, wait_for,
)

pytestmark = pytest.mark.operator
HOLD = "distflow.io/test-hold"


def _hold_pod(control_plane, namespace: str, pod: str, finalizers: list[str] | None) -> None:
    control_plane.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}",
                          {"metadata": {"finalizers": finalizers}},
                          content_type="application/merge-patch+json", expect=(200,))


def test_a_job_recreated_while_its_old_pod_terminates_says_so_and_runs_once_it_is_gone(
        control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("again"))
    first = api.wait_running_gang("again", attempt=1, num_nodes=2)
    old_uid = first[0]["metadata"]["ownerReferences"][0]["uid"]
    _hold_pod(control_plane, k8s_namespace, "again-node-0", [HOLD])  # Terminating until the test lets go
    try:
        api.delete_job("again")
        wait_for(lambda: api.job("again") is None and [p["metadata"]["name"] for p in api.pods("again")]
                 == ["again-node-0"], 60, what=lambda: f"the old job gone ({api.job('again') is None}), its node 0 "
                 f"Terminating (pods: {api.pod_summary('again')})")
        assert api.create_job(example_job("again"))[0] == 201
        status = api.wait_phase("again", "Pending", reason="StalePodsOfEarlierJob", timeout_s=20)
        assert "again-node-0" in status["message"] and old_uid in status["message"], status
        new_uid = api.job("again")["metadata"]["uid"]
        wait_for(lambda: [p["metadata"]["ownerReferences"][0]["uid"] for p in api.live_pods("again")] == [new_uid],
                 20, what="node 1 of the new job created beside the held name")
        events = [e for e in api.events("again") if e["reason"] == "StalePodsOfEarlierJob"]
        assert events and events[0]["involvedObject"]["uid"] == new_uid and "again-node-0" in events[0]["message"]
    finally:
        _hold_pod(control_plane, k8s_namespace, "again-node-0", None)
    pods = api.wait_running_gang("again", attempt=1, num_nodes=2, timeout_s=30)
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in pods} == {new_uid}
    status = api.wait_phase("again", "Running")
    assert (status["attempt"], status.get("restarts", 0)) == (1, 0)


def test_a_batch_scheduler_the_cluster_does_not_serve_fails_the_job_with_the_fix(control_plane, k8s_namespace,
                                                                                 api, operator):
    # The operator may create Volcano PodGroups (its RBAC grants it) but no Volcano CRD is installed: 404.
    api.create_job(example_job("novolcano", scheduling={"batchScheduler": "volcano"}))
    status = api.wait_phase("novolcano", "Failed", timeout_s=40)
    assert status["reason"] == "PodCreationRejected", status
    assert "404" in status["message"] and "spec.scheduling.batchScheduler=volcano" in status["message"], status
    assert not api.pods("novolcano")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def test_a_job_deleted_during_a_watch_gap_is_forgotten_and_its_series_go(control_plane, k8s_namespace, api,
                                                                         operator_kubeconfig_path):
    port = free_port()
    with operator_running(operator_kubeconfig_path, k8s_namespace, METRICS_PORT=str(port)):
        api.create_job(example_job("ghost"))
        api.wait_running_gang("ghost", attempt=1, num_nodes=2)
        api.wait_phase("ghost", "Running")
        assert 'job_name="ghost"' in _scrape(port)
        key = base64.b64encode(f"/registry/distflow.io/rlposttrainjobs/{k8s_namespace}/ghost".encode()).decode()

        def delete_unseen() -> None:  # no watch can replay a delete that was compacted away
            assert control_plane.etcd("kv/deleterange", {"key": key}).get("deleted") == "1"
            revision = control_plane.etcd("kv/range", {"key": key})["header"]["revision"]
            control_plane.etcd("kv/compaction", {"revision": revision, "physical": True})

        control_plane.restart_apiserver(while_down=delete_unseen)
        assert api.job("ghost") is None
        wait_for(lambda: 'job_name="ghost"' not in _scrape(port), 30, what="the ghost's series gone")
        # The garbage collector removes the orphaned pods; the operator must not create them again.
        wait_for(lambda: not api.pods("ghost"), 60, what="the ghost's pods collected")
        time.sleep(12)  # two resyncs (5 s)
        assert not api.pods("ghost")
