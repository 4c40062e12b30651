"""A 64-node job on 64 fake 8-GPU nodes: time from apply to every node pod Running, and
the operator's resident memory then; 500 jobs (1,000 pods) held against the chart's memory
limit (``-m long``). The operator runs as its own process (`python -m distflow_operator`,
least-privilege token) so its RSS is its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from tests.controlplane.cluster import fake_node, free_port
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    REPO, api, crd, example_job, operator_kubeconfig_path, wait_for,
)

pytestmark = pytest.mark.operator

NUM_NODES = 64


@pytest.fixture
def gpu_pool(control_plane, k8s_namespace):
    """64 extra kwok nodes labelled for this test only; deleted afterwards."""
    names = [f"pool-{k8s_namespace[-6:]}-{i}" for i in range(NUM_NODES)]
    for name in names:
        node = fake_node(name, gpus=8)
        node["metadata"]["labels"]["distflow.io/test-pool"] = k8s_namespace
        control_plane.request("POST", "/api/v1/nodes", node, expect=(201,))

    def ready() -> bool:
        _, body = control_plane.request(
            "GET", f"/api/v1/nodes?labelSelector=distflow.io%2Ftest-pool%3D{k8s_namespace}", expect=(200,))
        # Ready, and the node lifecycle controller has lifted its not-ready taint.
        return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
                   and not n["spec"].get("taints") for n in body["items"]) == NUM_NODES

    wait_for(ready, 90, 0.5, what="pool nodes Ready and untainted")
    yield k8s_namespace
    for name in names:
        control_plane.request("DELETE", f"/api/v1/nodes/{name}")


@pytest.fixture
def operator_process(operator_kubeconfig_path: Path, k8s_namespace, tmp_path):
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(operator_kubeconfig_path),
           "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"),
                                          os.environ.get("PYTHONPATH", "")])}
    log_path = tmp_path / "operator.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall a chatty operator
        proc = subprocess.Popen([sys.executable, "-m", "distflow_operator", "-n", k8s_namespace,
                                 "--metrics-port", str(port), "--liveness-port", "0"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _scrape(port), 30, 0.2, what="operator metrics endpoint")
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log = log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]


def _scrape(port: int) -> str | None:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None


def test_64_node_job_time_to_running_and_operator_memory(api, gpu_pool, operator_process):
    proc, port = operator_process
    rss_idle = psutil.Process(proc.pid).memory_info().rss
    job = example_job("big", cluster={"numNodes": NUM_NODES, "procsPerNode": 8, "acceleratorsPerNode": 8},
                      data={"trainBatchSize": 512},
                      template={"nodeSelector": {"distflow.io/test-pool": gpu_pool}})
    started = time.monotonic()
    status, body = api.create_job(job)
    assert status == 201, body
    milestones: dict[str, float] = {}

    def all_running():
        pods = api.pods("big")
        running = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
        for name, done in (("created", len(pods) == NUM_NODES),
                           ("scheduled", len(pods) == NUM_NODES and all(p["spec"].get("nodeName") for p in pods)),
                           ("running", len(running) == NUM_NODES)):
            if done:
                milestones.setdefault(name, time.monotonic() - started)
        return "running" in milestones and pods

    pods = wait_for(all_running, 120, 0.05, what="64 pods Running")
    api.wait_phase("big", "Running", timeout_s=60, readyNodes=NUM_NODES)
    status_running_s = time.monotonic() - started
    rss = psutil.Process(proc.pid).memory_info().rss
    pods_running_s = milestones["running"]

    assert len({p["spec"]["nodeName"] for p in pods}) == NUM_NODES  # one 8-GPU node per pod
    assert api.status("big")["nodes"] == f"{NUM_NODES}/{NUM_NODES}"
    # The operator records the histogram right after its status write lands.
    wait_for(lambda: "distflow_operator_time_to_running_seconds_count 1.0" in _scrape(port), 10,
             what="time-to-running observed")
    assert not [e for e in api.list("events") if e["reason"] == "FailedScheduling"]
    print(f"\n64-node job: apply -> all {NUM_NODES} pods created {milestones['created']:.2f}s, "
          f"scheduled {milestones['scheduled']:.2f}s, Running {pods_running_s:.2f}s; "
          f"-> status Running {NUM_NODES}/{NUM_NODES} {status_running_s:.2f}s; "
          f"operator RSS {rss / 2**20:.1f} MiB (idle before apply {rss_idle / 2**20:.1f} MiB)")
    assert pods_running_s < 60


def _mebibytes(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.long
def test_500_jobs_stay_under_the_charts_memory_limit(api, operator_process, report_figure):
    """Every job's status written and its pods tracked; the pods stay Pending (a scheduler that does
    not exist) so the measure is the operator's, not the scheduler's or kwok's."""
    proc, _port = operator_process
    process = psutil.Process(proc.pid)
    limit_mib = _mebibytes(yaml.safe_load((REPO / "helm/distflow/values.yaml").read_text())
                           ["resources"]["limits"]["memory"])
    idle_mib = process.memory_info().rss / 2**20
    num_jobs, peak = 500, [0.0]

    def create(i: int) -> None:
        job = example_job(f"mem-{i}", scheduling={"schedulerName": "no-such-scheduler"})
        status, body = api.create_job(job)
        assert status == 201, body
        peak[0] = max(peak[0], process.memory_info().rss / 2**20)

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(num_jobs)))

    def all_tracked() -> bool:
        peak[0] = max(peak[0], process.memory_info().rss / 2**20)
        _, body = api.cp.request("GET", f"/api/v1/namespaces/{api.ns}/pods?labelSelector=distflow.io%2Fjob-name",
                                 expect=(200,))
        return len(body["items"]) == 2 * num_jobs

    wait_for(all_tracked, 900, 1.0, what=f"{2 * num_jobs} node pods created")
    time.sleep(10)  # two more resyncs over every job
    peak[0] = max(peak[0], process.memory_info().rss / 2**20)
    report_figure(f"{num_jobs} jobs ({2 * num_jobs} pods) tracked {time.monotonic() - started:.0f}s after the "
                  f"first apply: operator RSS {idle_mib:.0f} MiB idle, peak {peak[0]:.0f} MiB "
                  f"(chart limit {limit_mib:.0f} MiB)")
    assert peak[0] < 0.8 * limit_mib, f"RSS peak {peak[0]:.0f} MiB against a {limit_mib:.0f} MiB limit"
