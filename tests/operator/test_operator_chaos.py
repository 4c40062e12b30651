"""Chaos tier: the operator (two replicas, Lease leader election) under killed leaders, API
server restarts, NotReady nodes, floods of bad CRs and 8-node jobs applied at once.

Opt-in (``pytest -m chaos tests/operator/test_operator_chaos.py``): short loops by default, the
issue-sized ones with DISTFLOW_CHAOS_LONG=1 (x10 kills, x5 restarts, x5 NotReady, 200 bad CRs,
100 jobs x 8 nodes, 5,000 unrelated pods). Each fault also has one scenario in the default
operator tier (test_operator_faults.py). Each test prints one ``CHAOS`` summary line with its
figures (run with -s to see them).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.controlplane.cluster import fake_node
from tests.operator._chaos import LONG, PodObserver, Replicas, bad_specs
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    CRD_FILE, api, crd, example_job, operator_kubeconfig_path, wait_for,
)

pytestmark = [pytest.mark.operator, pytest.mark.chaos]


@pytest.fixture
def replicas(control_plane, operator_kubeconfig_path, k8s_namespace, tmp_path):
    pool = Replicas(control_plane, operator_kubeconfig_path, k8s_namespace, tmp_path)
    pool.start()
    pool.start()
    wait_for(pool.leader_pid, 30, 0.2, what="a leader elected")
    yield pool
    pool.stop()
    assert not pool.crashed(), "\n----\n".join(pool.crashed())


def _next_attempt(api, job: str, attempt: int, timeout_s: float = 60.0) -> dict:
    api.wait_running_gang(job, attempt=attempt, num_nodes=2, timeout_s=timeout_s)
    return api.wait_phase(job, "Running", attempt=attempt, timeout_s=timeout_s)


def test_chaos_leader_killed_at_random_points_mid_job(control_plane, k8s_namespace, api, replicas):
    kills = 10 if LONG else 3
    rng = random.Random(13)
    observer = PodObserver(control_plane, k8s_namespace)
    observer.start()
    api.create_job(example_job("kill", runPolicy={"maxRestarts": 100, "backoffSeconds": 0}))
    _next_attempt(api, "kill", 1)
    started = time.monotonic()
    try:
        for i in range(kills):
            # A killed leader holds the Lease until it expires; the dead one may have finished the
            # last restart itself, so wait for the new one before the next fault.
            wait_for(replicas.live_leader, 30, 0.2, what="a live replica holds the Lease")
            control_plane.set_pod_phase(k8s_namespace, f"kill-node-{rng.randrange(2)}", "Failed", exit_code=1)
            time.sleep(rng.uniform(0.0, 1.0))  # anywhere from before the decision to mid-recreate
            assert replicas.kill_leader(), "the leader died on its own"
            replicas.start()
            status = _next_attempt(api, "kill", i + 2)
    finally:
        duplicates = observer.duplicates()
    lost = kills - status["restarts"]
    print(f"\nCHAOS leader killed x{replicas.kills} at random points: {duplicates} duplicate pods, {lost} lost "
          f"transitions (restarts {status['restarts']}, attempt {status['attempt']}), "
          f"{time.monotonic() - started:.1f}s")
    assert (duplicates, lost, status["attempt"]) == (0, 0, kills + 1)


def test_chaos_api_server_restarted_during_gang_restarts(control_plane, k8s_namespace, api, replicas):
    restarts = 5 if LONG else 1
    api.create_job(example_job("apirs", runPolicy={"maxRestarts": 100, "backoffSeconds": 0}))
    _next_attempt(api, "apirs", 1)
    started = time.monotonic()
    for i in range(restarts):
        control_plane.set_pod_phase(k8s_namespace, "apirs-node-1", "Failed", exit_code=1)
        time.sleep(random.Random(i).uniform(0.0, 0.5))
        control_plane.restart_apiserver()
        status = _next_attempt(api, "apirs", i + 2, timeout_s=90)
    for rank in (0, 1):
        control_plane.set_pod_phase(k8s_namespace, f"apirs-node-{rank}", "Succeeded")
    final = api.wait_phase("apirs", "Succeeded", timeout_s=30)
    print(f"\nCHAOS API server restarted x{restarts} during gang restarts: terminal phase {final['phase']}, "
          f"restarts {status['restarts']}, {time.monotonic() - started:.1f}s")
    assert status["restarts"] == restarts


def test_chaos_node_not_ready_during_gang_restarts(control_plane, k8s_namespace, api, replicas):
    rounds = 5 if LONG else 1
    api.create_job(example_job("nrdy", runPolicy={"maxRestarts": 100, "backoffSeconds": 0,
                                                  "terminatingTimeoutSeconds": 0}))
    _next_attempt(api, "nrdy", 1)
    started = time.monotonic()
    for i in range(rounds):
        control_plane.stop_kwok()
        try:
            control_plane.set_pod_phase(k8s_namespace, "nrdy-node-1", "Failed", exit_code=1)
            wait_for(lambda: {p["metadata"]["labels"]["distflow.io/attempt"] for p in api.pods("nrdy")}
                     == {str(i + 2)}, 90, 0.2, what=f"attempt {i + 1} force-deleted")
        finally:
            control_plane.start_kwok()
        status = _next_attempt(api, "nrdy", i + 2)
    print(f"\nCHAOS node NotReady (kubelet gone) x{rounds}: every restart completed, restarts "
          f"{status['restarts']}, {time.monotonic() - started:.1f}s")
    assert status["restarts"] == rounds


def test_chaos_generated_bad_crs_are_rejected_or_failed_with_a_reason(control_plane, k8s_namespace, api,
                                                                      replicas):
    count = 200 if LONG else 40
    specs = bad_specs(yaml.safe_load(CRD_FILE.read_text()), example_job()["spec"], count)
    outcomes = {"rejected": 0, "failed": 0, "accepted": []}
    created = []
    for i, (what, spec) in enumerate(specs):
        doc = example_job(f"bad-{i}")
        doc["spec"] = spec
        status, body = api.create_job(doc)
        if status in (400, 422):
            outcomes["rejected"] += 1
        else:
            created.append((f"bad-{i}", what, status, body.get("message")))
    for name, what, status, message in created:
        try:
            api.wait_phase(name, "Failed", timeout_s=20)
            outcomes["failed"] += 1
        except TimeoutError:
            outcomes["accepted"].append((what, status, message, api.status(name).get("phase")))
    handled = outcomes["rejected"] + outcomes["failed"]
    print(f"\nCHAOS {count} generated bad CRs: {100 * handled / count:.0f}% handled ({outcomes['rejected']} rejected "
          f"by the API server, {outcomes['failed']} Failed with a reason), operator crashes "
          f"{len(replicas.crashed())}")
    assert not outcomes["accepted"], outcomes["accepted"]


@pytest.fixture
def node_pool(control_plane, k8s_namespace):
    """Extra 110-pod kwok nodes for this test only; deleted afterwards."""
    names = [f"chaos-{k8s_namespace[-6:]}-{i}" for i in range(10 if LONG else 2)]
    for name in names:
        node = fake_node(name, gpus=8)
        node["metadata"]["labels"]["distflow.io/test-pool"] = k8s_namespace
        control_plane.request("POST", "/api/v1/nodes", node, expect=(201,))
    yield k8s_namespace
    for name in names:
        control_plane.request("DELETE", f"/api/v1/nodes/{name}")


def test_chaos_many_8_node_jobs_applied_at_once(control_plane, k8s_namespace, api, replicas, node_pool):
    num_jobs = 100 if LONG else 10
    small = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    started = time.monotonic()
    for i in range(num_jobs):
        status, body = api.create_job(example_job(
            f"many-{i}", cluster={"numNodes": 8, "procsPerNode": 1, "acceleratorsPerNode": 0},
            data={"trainBatchSize": 8},
            template={"resources": small, "nodeSelector": {"distflow.io/test-pool": node_pool}}))
        assert status == 201, body

    def all_running() -> bool:
        _, body = control_plane.request("GET", api.jobs)
        return sum(j.get("status", {}).get("phase") == "Running" for j in body["items"]) == num_jobs

    wait_for(all_running, 600 if LONG else 120, 0.5, what=f"{num_jobs} jobs Running")
    elapsed = time.monotonic() - started
    print(f"\nCHAOS {num_jobs} jobs x 8 nodes applied at once: all Running in {elapsed:.1f}s, "
          f"leader RSS {replicas.rss_mib():.0f} MiB")


def test_chaos_unrelated_pods_cost_the_operator_nothing(control_plane, k8s_namespace, api, replicas):
    count = 5000 if LONG else 500
    api.create_job(example_job("mine"))
    api.wait_phase("mine", "Running")
    time.sleep(3.0)
    before = replicas.rss_mib()
    pod = {"apiVersion": "v1", "kind": "Pod",
           "spec": {"schedulerName": "no-such-scheduler",  # stays Pending: no scheduler or kwok work
                    "containers": [{"name": "c", "image": "busybox"}]}}

    def create(i: int) -> None:
        control_plane.request("POST", f"/api/v1/namespaces/{k8s_namespace}/pods",
                              {**pod, "metadata": {"name": f"other-{i}", "labels": {"app": "other"}}},
                              expect=(201,))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(count)))
    time.sleep(5.0)  # two resyncs
    after = replicas.rss_mib()
    print(f"\nCHAOS {count} unrelated pods in the watched namespace: operator RSS {before:.0f} -> {after:.0f} MiB")
    assert api.status("mine")["phase"] == "Running"
