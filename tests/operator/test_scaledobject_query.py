"""examples/scaledobject.yaml's query, run by a real Prometheus on what an asynchronous job's nodes serve,
moves the job to the size where its two pools keep pace, as the HorizontalPodAutoscaler would.

KEDA hands the query's value to the HPA as an external metric; with ``metricType: Value`` the HPA asks
for ceil(ready pods x value / threshold) nodes, unless value / threshold is within its 10% tolerance
of 1, clamped to [minReplicaCount, maxReplicaCount] (kube-controller-manager's replica calculator,
``GetExternalMetricReplicas``). The test serves a job's series (``NodeExporter`` on each node, as each
node pod does) from a model of the two overlapped pools: the rollout pool generates a step in G
seconds, the T trainer nodes train it in W / T, and on top of both the sample transfer and the weight
sync cost the same at every size. Debian's Prometheus scrapes them and evaluates the example's query,
and the test iterates the HPA's rule: trainers slower than the rollout grow the job to the trainer
count that keeps pace (or maxReplicaCount), faster ones shrink it, and the transfer cost moves
nothing. (The first example's summed rollout backlog could not: it stopped at 3 of 5.) KEDA itself
reads the same query in tests/operator/test_keda.py (-m keda).
"""

from __future__ import annotations

import math

import pytest
import yaml

from distflow.exporter import NodeExporter
from tests.controlplane.cluster import free_port
from tests.operator._helpers import REPO, wait_for
from tests.operator.test_dashboard import Prometheus, scraped

pytestmark = pytest.mark.operator

HPA_TOLERANCE = 0.1
"""kube-controller-manager's default --horizontal-pod-autoscaler-tolerance."""
OVERHEAD_S = 0.4
"""Sample transfer and weight sync per step, at every size: in neither stage."""


def hpa_size(current: int, value: float, threshold: float, low: int, high: int) -> int:
    """The HPA's next size for an external metric of target type Value."""
    ratio = value / threshold
    wanted = current if abs(1.0 - ratio) <= HPA_TOLERANCE else math.ceil(ratio * current)
    return min(high, max(low, wanted))


def test_the_example_query_sizes_the_async_job_where_its_pools_keep_pace(tmp_path):
    scaled = yaml.safe_load((REPO / "examples" / "scaledobject.yaml").read_text())
    job = yaml.safe_load((REPO / "examples" / "rljob-async.yaml").read_text())
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metricType"] == "Value"
    query, threshold = trigger["metadata"]["query"], float(trigger["metadata"]["threshold"])
    low, high = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    cluster = job["spec"]["cluster"]
    assert (low, high) == (cluster["minNodes"], cluster["maxNodes"])
    name, rollout_nodes = job["metadata"]["name"], job["spec"]["async"]["rolloutPool"]["numNodes"]

    ports = [free_port() for _ in range(high)]
    exporters = [NodeExporter(name, node, port) for node, port in enumerate(ports)]
    step = 0

    def value(size: int, train_s_one_node: float, generate_s: float) -> float:
        """Serve one step of the pools at ``size`` nodes (every node serves the job's global metrics;
        nodes past the size serve the same, as a ready pod would), then read the query once scraped."""
        nonlocal step
        step += 1
        train_s = train_s_one_node / (size - rollout_nodes)
        metrics = {"timing_s/train": train_s, "timing_s/generate": generate_s,
                   "timing_s/step": max(train_s, generate_s) + OVERHEAD_S,
                   "async/trainer_wait_s": max(0.0, generate_s - train_s) + OVERHEAD_S}
        for exporter in exporters:
            exporter.observe_step(step, metrics, {}, 100.0, 0.0, 0.0)

        def read() -> float | None:
            seen = prometheus.api("query", query=f'min(distflow_step{{job_name="{name}"}})')["result"]
            if not seen or int(float(seen[0]["value"][1])) != step:
                return None  # not every node scraped since this step
            (sample,) = prometheus.api("query", query=query)["result"]
            return float(sample["value"][1])
        return wait_for(read, 30, 0.5, what=f"{query} after step {step}")

    def settle(size: int, train_s_one_node: float, generate_s: float) -> list[int]:
        sizes = [size]
        while (nxt := hpa_size(size, value(size, train_s_one_node, generate_s), threshold, low, high)) != size:
            sizes.append(size := nxt)
            assert len(sizes) < 8, f"no settled size: {sizes}"
        return sizes

    prometheus = Prometheus(tmp_path, {"distflow-nodes": ports})
    try:
        wait_for(lambda: scraped(prometheus, "distflow-nodes", high), 30, 0.5, what="every node scraped")
        # Training a step takes 3 s on one trainer node, generating it 1 s: 3 trainers keep pace.
        # 2 trainers: 1.5 -> ceil(3 x 1.5) = 5 nodes; 4: 0.75 -> ceil(5 x 0.75) = 4; 3 trainers: 1.0, held.
        assert settle(3, 3.0, 1.0) == [3, 5, 4]
        # The rollout slows down (longer responses, 2 s): 3 trainers train in half its time.
        # 0.5 -> ceil(4 x 0.5) = 2, held at minReplicaCount 3; 2 trainers: 0.75 -> ceil(2.25) = 3.
        assert settle(4, 3.0, 2.0) == [4, 3]
        # Trainers far behind (a larger model, 10 s on one node): maxReplicaCount and held there.
        assert settle(3, 10.0, 1.0) == [3, 5]
        # No series of the job (every node pod gone while the gang restarts): the size holds.
        gone = query.replace(f'job_name="{name}"', 'job_name="restarting"')
        (sample,) = prometheus.api("query", query=gone)["result"]
        assert hpa_size(4, float(sample["value"][1]), threshold, low, high) == 4
    finally:
        prometheus.stop()
