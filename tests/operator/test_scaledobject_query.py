"""examples/scaledobject.yaml's query, run by a real Prometheus on what an asynchronous job's nodes serve,
moves the job across its whole size range as the HorizontalPodAutoscaler would.

KEDA hands the query's value to the HPA as an external metric; with ``metricType: Value`` the HPA asks
for ceil(ready pods x value / threshold) nodes, unless value / threshold is within its 10% tolerance
of 1, clamped to [minReplicaCount, maxReplicaCount] (kube-controller-manager's replica calculator,
``GetExternalMetricReplicas``). The test serves a three-node job's series (``NodeExporter``, as each
node pod does, with the step metrics of an asynchronous run), has Debian's Prometheus scrape them and
evaluate the example's query, and iterates the HPA's rule: trainers busy the whole step must reach
maxReplicaCount, trainers waiting half of it minReplicaCount, and a job that serves nothing (its gang
restarting) keeps its size. (A query that sums a job-wide value over the nodes could not: the first
example's stopped at 3 of 5.) KEDA itself reads the same query in tests/operator/test_keda.py (-m keda).
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
STEP_S = 10.0


def hpa_size(current: int, value: float, threshold: float, low: int, high: int) -> int:
    """The HPA's next size for an external metric of target type Value."""
    ratio = value / threshold
    wanted = current if abs(1.0 - ratio) <= HPA_TOLERANCE else math.ceil(ratio * current)
    return min(high, max(low, wanted))


def test_the_example_query_takes_the_async_job_to_its_max_and_min_size(tmp_path):
    scaled = yaml.safe_load((REPO / "examples" / "scaledobject.yaml").read_text())
    job = yaml.safe_load((REPO / "examples" / "rljob-async.yaml").read_text())
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metricType"] == "Value"
    query, threshold = trigger["metadata"]["query"], float(trigger["metadata"]["threshold"])
    low, high = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    cluster = job["spec"]["cluster"]
    assert (low, high) == (cluster["minNodes"], cluster["maxNodes"])
    name, nodes = job["metadata"]["name"], cluster["numNodes"]
    staleness, batch, n = (job["spec"]["async"]["maxStaleness"], job["spec"]["data"]["trainBatchSize"],
                           job["spec"]["rollout"]["n"])

    ports = [free_port() for _ in range(nodes)]
    exporters = [NodeExporter(name, node, port) for node, port in enumerate(ports)]

    def serve(trainer_wait_s: float, step: int) -> None:
        # One step's global metrics, the same on every node; the backlog full when the trainers never wait.
        in_flight = staleness * batch * n if trainer_wait_s == 0 else 0
        for exporter in exporters:
            exporter.observe_step(step, {"timing_s/step": STEP_S, "async/trainer_wait_s": trainer_wait_s,
                                         "async/in_flight_samples": float(in_flight)}, {}, 100.0, 0.0, 0.0)

    def value(expr: str, expected_step: int) -> float:
        def read() -> float | None:
            step = prometheus.api("query", query=f'max(distflow_step{{job_name="{name}"}})')["result"]
            if not step or int(float(step[0]["value"][1])) != expected_step:
                return None  # not scraped since the step changed
            (sample,) = prometheus.api("query", query=expr)["result"]
            return float(sample["value"][1])
        return wait_for(read, 30, 0.5, what=f"{expr} after step {expected_step}")

    prometheus = Prometheus(tmp_path, {"distflow-nodes": ports})
    try:
        serve(0.0, step=1)
        wait_for(lambda: scraped(prometheus, "distflow-nodes", nodes), 30, 0.5, what="every node scraped")
        sizes, size = [nodes], nodes
        while True:  # trainers busy the whole step: grow until maxReplicaCount
            grown = hpa_size(size, value(query, 1), threshold, low, high)
            if grown == size:
                break
            sizes.append(size := grown)
        assert sizes == [3, 4, 5], sizes

        serve(0.5 * STEP_S, step=2)  # trainers wait half the step: shrink to minReplicaCount
        while (shrunk := hpa_size(size, value(query, 2), threshold, low, high)) != size:
            sizes.append(size := shrunk)
        assert sizes == [3, 4, 5, 4, 3], sizes

        # No series of the job (every node pod gone while the gang restarts): the size holds.
        gone = query.replace(f'job_name="{name}"', 'job_name="restarting"')
        (sample,) = prometheus.api("query", query=gone)["result"]
        assert hpa_size(4, float(sample["value"][1]), threshold, low, high) == 4
    finally:
        prometheus.stop()
