"""Chaos tier: the operator (two replicas, Lease leader election) under killed leaders, API
server restarts, NotReady nodes, floods of bad CRs and 8-node jobs applied at once.

Every loop has two forms. The short one (``[short]``) is part of the operator tier and of the
default run: x3 kills, x1 API server restart, x1 NotReady, 40 bad CRs, 10 jobs x 8 nodes, 500
unrelated pods. The long one (``[long]``, marked ``long``: ``pytest -m long
tests/operator/test_operator_chaos.py``) has the issue-sized figures: x10 kills, x5 restarts,
x5 NotReady, 200 bad CRs, 100 jobs x 8 nodes, 5,000 unrelated pods. Each test records one
``CHAOS`` line with its figures; the run's summary prints them all.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import yaml

from tests.controlplane.cluster import fake_node
from tests.operator._chaos import PodObserver, Replicas, bad_specs
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    CRD_FILE, api, crd, example_job, operator_kubeconfig_path, wait_for,
)

pytestmark = [pytest.mark.operator, pytest.mark.chaos]


@dataclass(frozen=True)
class Loops:
    """How many times each loop injects its fault."""

    leader_kills: int
    api_server_restarts: int
    not_ready_rounds: int
    bad_crs: int
    num_jobs: int
    pool_nodes: int
    """110-pod kwok nodes added for the many-jobs loop (8 pods per job)."""
    unrelated_pods: int
    running_timeout_s: float


SHORT = Loops(leader_kills=3, api_server_restarts=1, not_ready_rounds=1, bad_crs=40, num_jobs=10, pool_nodes=2,
              unrelated_pods=500, running_timeout_s=120)
LONG = Loops(leader_kills=10, api_server_restarts=5, not_ready_rounds=5, bad_crs=200, num_jobs=100, pool_nodes=10,
             unrelated_pods=5000, running_timeout_s=600)


@pytest.fixture(params=[pytest.param(SHORT, id="short"), pytest.param(LONG, id="long", marks=pytest.mark.long)])
def loops(request) -> Loops:
    return request.param


@pytest.fixture
def replicas(control_plane, operator_kubeconfig_path, k8s_namespace, tmp_path):
    pool = Replicas(control_plane, operator_kubeconfig_path, k8s_namespace, tmp_path)
    pool.start()
    pool.start()
    wait_for(pool.leader_pid, 30, 0.2, what="a leader elected")
    yield pool
    pool.stop()
    assert not pool.crashed(), "\n----\n".join(pool.crashed())


def _components_restarted(control_plane, since: int) -> str:
    """Which control plane components exited on their own (and were started again) since ``since``."""
    exits = control_plane.restarts[since:]
    return ", ".join(f"{e.name} (exit {e.returncode})" for e in exits) or "none"


def _next_attempt(api, job: str, attempt: int, timeout_s: float = 60.0) -> dict:
    api.wait_running_gang(job, attempt=attempt, num_nodes=2, timeout_s=timeout_s)
    return api.wait_phase(job, "Running", attempt=attempt, timeout_s=timeout_s)


def test_chaos_leader_killed_at_random_points_mid_job(control_plane, k8s_namespace, api, replicas, loops,
                                                      report_figure):
    kills = loops.leader_kills
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
    report_figure(f"operator leader killed x{replicas.kills} at random points mid-job: {duplicates} duplicate pods, "
                  f"{lost} lost transitions (restarts {status['restarts']}, attempt {status['attempt']}), "
                  f"{time.monotonic() - started:.1f}s")
    assert (duplicates, lost, status["attempt"]) == (0, 0, kills + 1)


def test_chaos_api_server_restarted_during_gang_restarts(control_plane, k8s_namespace, api, replicas, loops,
                                                         report_figure):
    """Two jobs restart their gangs while the API server goes down, round after round: ``last`` runs out
    of restarts in the last round (Failed across the outage), ``apirs`` succeeds afterwards."""
    restarts = loops.api_server_restarts
    jobs = {"apirs": 100, "last": restarts - 1}
    for job, max_restarts in jobs.items():
        api.create_job(example_job(job, runPolicy={"maxRestarts": max_restarts, "backoffSeconds": 0}))
        _next_attempt(api, job, 1)
    rng = random.Random(5)
    started, exits = time.monotonic(), len(control_plane.restarts)
    for i in range(restarts):
        for job in jobs:
            control_plane.set_pod_phase(k8s_namespace, f"{job}-node-{rng.randrange(2)}", "Failed", exit_code=1)
        time.sleep(rng.uniform(0.0, 0.5))
        control_plane.restart_apiserver()
        status = _next_attempt(api, "apirs", i + 2, timeout_s=90)
        if i + 1 < restarts:
            _next_attempt(api, "last", i + 2, timeout_s=90)
    for rank in (0, 1):
        control_plane.set_pod_phase(k8s_namespace, f"apirs-node-{rank}", "Succeeded")
    final = {"apirs": api.wait_phase("apirs", "Succeeded", timeout_s=30),
             "last": api.wait_phase("last", "Failed", timeout_s=30)}
    report_figure(f"API server restarted x{restarts} during gang restarts: {len(final)}/{len(jobs)} jobs reached "
                  f"their terminal phase (" + ", ".join(f"{j['phase']}/{j.get('reason')} after {j['restarts']} "
                                                        "restarts" for j in final.values()) +
                  f"), {time.monotonic() - started:.1f}s; control plane components that exited and were started "
                  f"again: {_components_restarted(control_plane, exits)}")
    assert status["restarts"] == restarts
    assert (final["last"]["reason"], final["last"]["restarts"]) == ("MaxRestartsExceeded", restarts - 1)


def _node_ready(control_plane, name: str) -> str:
    _, node = control_plane.request("GET", f"/api/v1/nodes/{name}", expect=(200,))
    return next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "Unknown")


def test_chaos_node_not_ready_during_gang_restarts(control_plane, k8s_namespace, api, replicas, loops,
                                                   report_figure):
    """Each round the kubelets go (kwok stopped) and a node pod fails: the old attempt's pods stay
    Terminating until the operator force-deletes them, and the round ends only once the controller-manager
    has marked the failed pod's node NotReady (its 50 s node-monitor grace period)."""
    rounds = loops.not_ready_rounds
    api.create_job(example_job("nrdy", runPolicy={"maxRestarts": 100, "backoffSeconds": 0,
                                                  "terminatingTimeoutSeconds": 0}))
    _next_attempt(api, "nrdy", 1)
    started, exits, not_ready = time.monotonic(), len(control_plane.restarts), []
    for i in range(rounds):
        node = api.get("pods", "nrdy-node-1")["spec"]["nodeName"]
        control_plane.stop_kwok()
        gone = time.monotonic()
        try:
            control_plane.set_pod_phase(k8s_namespace, "nrdy-node-1", "Failed", exit_code=1)
            wait_for(lambda: {p["metadata"]["labels"]["distflow.io/attempt"] for p in api.pods("nrdy")}
                     == {str(i + 2)}, 90, 0.2, what=f"attempt {i + 1} force-deleted")
            wait_for(lambda: _node_ready(control_plane, node) != "True", 90, 0.5, what=f"{node} NotReady")
            not_ready.append(time.monotonic() - gone)
        finally:
            control_plane.start_kwok()
        status = _next_attempt(api, "nrdy", i + 2)
    report_figure(f"node NotReady (kubelet gone) x{len(not_ready)} during gang restarts: {status['restarts']}/{rounds} "
                  f"restarts completed (old pods force-deleted after their 30 s grace period; node NotReady "
                  f"{min(not_ready):.0f}-{max(not_ready):.0f}s after its kubelet went), "
                  f"{time.monotonic() - started:.1f}s; control plane components that exited and were started again: "
                  f"{_components_restarted(control_plane, exits)}")
    assert (status["restarts"], len(not_ready)) == (rounds, rounds)


def test_chaos_generated_bad_crs_are_rejected_or_failed_with_a_reason(control_plane, k8s_namespace, api,
                                                                      replicas, loops, report_figure):
    count = loops.bad_crs
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
            failed = api.wait_phase(name, "Failed", timeout_s=20)
            outcomes["failed"] += bool(failed.get("reason") and failed.get("message"))
        except TimeoutError:
            outcomes["accepted"].append((what, status, message, api.status(name).get("phase")))
    handled = outcomes["rejected"] + outcomes["failed"]
    crashes = len(replicas.crashed())
    report_figure(f"{count} generated bad CRs: {100 * handled / count:.0f}% handled ({outcomes['rejected']} "
                  f"rejected by the API server, {outcomes['failed']} Failed with a reason), {crashes} operator "
                  "crashes")
    assert (handled, crashes) == (count, 0), outcomes["accepted"]


@pytest.fixture
def node_pool(control_plane, k8s_namespace, loops):
    """Extra 110-pod kwok nodes for this test only; deleted afterwards."""
    names = [f"chaos-{k8s_namespace[-6:]}-{i}" for i in range(loops.pool_nodes)]
    for name in names:
        node = fake_node(name, gpus=8)
        node["metadata"]["labels"]["distflow.io/test-pool"] = k8s_namespace
        control_plane.request("POST", "/api/v1/nodes", node, expect=(201,))
    yield k8s_namespace
    for name in names:
        control_plane.request("DELETE", f"/api/v1/nodes/{name}")


def test_chaos_many_8_node_jobs_applied_at_once(control_plane, k8s_namespace, api, replicas, node_pool, loops,
                                                report_figure):
    num_jobs = loops.num_jobs
    small = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    docs = [example_job(f"many-{i}", cluster={"numNodes": 8, "procsPerNode": 1, "acceleratorsPerNode": 0},
                        data={"trainBatchSize": 8},
                        template={"resources": small, "nodeSelector": {"distflow.io/test-pool": node_pool}})
            for i in range(num_jobs)]
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:  # as a CI pipeline or a sweep would: many clients at once
        created = list(pool.map(api.create_job, docs))
    applied = time.monotonic() - started
    assert all(status == 201 for status, _ in created), [body for status, body in created if status != 201][:3]
    peak_rss = [0.0]

    def all_running() -> bool:
        peak_rss[0] = max(peak_rss[0], replicas.rss_mib())
        _, body = control_plane.request("GET", api.jobs)
        return sum(j.get("status", {}).get("phase") == "Running" for j in body["items"]) == num_jobs

    wait_for(all_running, loops.running_timeout_s, 0.5, what=f"{num_jobs} jobs Running")
    elapsed = time.monotonic() - started
    running_pods = sum(p["status"].get("phase") == "Running" for p in api.list("pods", "distflow.io/job-name"))
    report_figure(f"{num_jobs} jobs x 8 nodes applied at once ({applied:.1f}s to apply): all {num_jobs} Running "
                  f"({running_pods} pods) {elapsed:.1f}s after the first apply, operator RSS peak "
                  f"{peak_rss[0]:.0f} MiB")
    assert running_pods == 8 * num_jobs


def test_chaos_unrelated_pods_cost_the_operator_nothing(control_plane, k8s_namespace, api, replicas, loops,
                                                        report_figure):
    count = loops.unrelated_pods
    api.create_job(example_job("mine"))
    api.wait_phase("mine", "Running")
    time.sleep(3.0)
    before, received_before, started = replicas.rss_mib(), replicas.pods_received(), time.monotonic()
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
    after, received = replicas.rss_mib(), replicas.pods_received() - received_before
    elapsed = time.monotonic() - started
    report_figure(f"{count} unrelated pods in the watched namespace: operator RSS {before:.0f} -> {after:.0f} MiB, "
                  f"{received:.0f} pods received by watch and LIST")
    assert api.status("mine")["phase"] == "Running"
    # Two replicas relist every 2 s, each LIST holding the 2 pods of "mine", plus a few watch events.
    # Had the API server sent the unrelated pods, one LIST alone would hold `count` more.
    limit = 2 * 2 * (elapsed / 2 + 2) + 10
    assert limit < count and 0 < received <= limit, (received, elapsed)
