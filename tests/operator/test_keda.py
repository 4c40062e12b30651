"""KEDA scales an RLPostTrainJob on distflow's metric, read by a real Prometheus.

On the real API server: KEDA's own operator and metrics API server (built from
its Go module by tests/controlplane/build_keda.sh; see tests/controlplane/keda.py),
the aggregation layer serving external.metrics.k8s.io from KEDA, the
HorizontalPodAutoscaler controller of kube-controller-manager, the distflow
operator, and Debian's Prometheus scraping a node exporter of distflow's
(``NodeExporter``, the class a job's node 0 serves its metrics with) whose
stage times the test sets (an asynchronous run's train and generate stages). A ScaledObject on the
job, with the Prometheus trigger of examples/scaledobject.yaml (train time over generate time,
metricType Value), must move ``spec.cluster.numNodes`` through the CRD's scale subresource from 2 to 4
when training takes 1.5x the rollout's time, and back to 2 when it takes 0.6x. The job here is
synchronous (kwok runs no runtime; an asynchronous job's trainer resize, a stop and a gang restart, is
tests/unit/test_policy_pool_resize.py's and the exit-3 path of tests/operator/test_operator_resize.py), so the operator's gang follows in place: it creates the new ranks' pods in
the running attempt for a grow, and deletes the leaving ranks' pods once they exit 4 (played here)
for a shrink, counting no restart.

Opt-in (``-m keda``), and skipped, saying why, until the KEDA binaries are
built (``bash tests/controlplane/build_keda.sh``; long: KEDA links every scaler).
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import yaml

from distflow.exporter import NodeExporter
from tests.controlplane.cluster import free_port
from tests.controlplane.keda import Keda, cached_keda_bin
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    REPO, api, crd, example_job, operator, operator_kubeconfig_path, wait_for,
)
from tests.operator.test_dashboard import Prometheus

KEDA_BIN, NOT_BUILT = cached_keda_bin()
# Checked before any fixture: a skip must not wait for the control plane to start.
pytestmark = [pytest.mark.operator, pytest.mark.keda,
              pytest.mark.skipif(KEDA_BIN is None, reason=f"KEDA not built: {NOT_BUILT}")]

EXAMPLE = REPO / "examples" / "scaledobject.yaml"
STEP_S = 10.0
"""The step time the node serves; the trainers' wait is a share of it."""
SCALE_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def keda(control_plane):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (apt-get install -y --no-install-recommends prometheus)")
    with Keda(KEDA_BIN, control_plane) as running:
        yield running


def scaled_object(job: str, prometheus_url: str) -> dict:
    """examples/scaledobject.yaml for ``job``, querying the test's Prometheus, acting at once."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = job
    doc["spec"]["scaleTargetRef"]["name"] = job
    trigger = doc["spec"]["triggers"][0]["metadata"]
    trigger["serverAddress"] = prometheus_url
    trigger["query"] = re.sub(r'job_name="[^"]*"', f'job_name="{job}"', trigger["query"])
    trigger["ignoreNullValues"] = "false"  # a query that finds nothing is an error, not 0
    doc["spec"].update(pollingInterval=2, minReplicaCount=2, maxReplicaCount=4)
    # No stabilization: HPA's 5-minute scale-down window would outlast the test.
    doc["spec"]["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": {
        direction: {"stabilizationWindowSeconds": 0, "policies": [{"type": "Percent", "value": 100,
                                                                   "periodSeconds": 1}]}
        for direction in ("scaleUp", "scaleDown")}}}
    return doc


def test_scaled_object_resizes_the_job_on_train_over_generate_time(control_plane, k8s_namespace, api, operator, keda,
                                                              tmp_path, report_figure):
    name = "grpo-keda"
    node0 = NodeExporter(name, node=0, port=(exporter_port := free_port()))

    def push_train_over_generate(ratio: float) -> None:
        node0.observe_step(1, {"timing_s/step": STEP_S, "timing_s/train": STEP_S,
                               "timing_s/generate": STEP_S / ratio}, {}, 0.0, 0.0, 0.0)

    threshold = float(yaml.safe_load(EXAMPLE.read_text())["spec"]["triggers"][0]["metadata"]["threshold"])
    push_train_over_generate(threshold)  # the pools keep pace: the HPA keeps the size
    prometheus = Prometheus(tmp_path, {"distflow-nodes": [exporter_port]})
    try:
        code, body = api.create_job(example_job(name, cluster={"numNodes": 2, "minNodes": 2, "maxNodes": 4},
                                                 # every size 2..4 splits the batch: the HPA passes through 3
                                                 data={"trainBatchSize": 12}))
        assert code == 201, body
        api.wait_phase(name, "Running", timeout_s=60, replicas=2)
        out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-",
                                    input=yaml.safe_dump(scaled_object(name, prometheus.url)))
        assert out.returncode == 0, out.stderr

        hpa = wait_for(lambda: _hpa(control_plane, k8s_namespace, name), 60, 0.5,
                       what=lambda: f"KEDA's HPA ({keda.log_tail('keda-operator', 10)})")
        assert (hpa["spec"]["scaleTargetRef"], hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == \
            ({"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob", "name": name}, 2, 4)
        metric = hpa["spec"]["metrics"][0]["external"]
        assert metric["target"]["type"] == "Value" and _quantity(metric["target"]["value"]) == threshold

        # Through the aggregation layer, as the HPA controller reads it: Prometheus' answer.
        selector = ",".join(f"{k}={v}" for k, v in metric["metric"]["selector"]["matchLabels"].items())
        path = (f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{k8s_namespace}/"
                f"{metric['metric']['name']}?labelSelector={selector}")
        assert _external_value(control_plane, keda, path, threshold) == threshold

        started = time.monotonic()
        push_train_over_generate(1.5)  # ceil(2 x 1.5) = 3, then ceil(3 x 1.5) = 5, held at 4 nodes
        _wait_num_nodes(api, keda, name, 4)
        scaled_up_s = time.monotonic() - started
        assert _external_value(control_plane, keda, path, 1.5) == 1.5
        _resize_in_place(control_plane, api, k8s_namespace, name, num_nodes=4)
        status = api.wait_phase(name, "Running", timeout_s=90, replicas=4, attempt=1)
        assert status["selector"] == f"app.kubernetes.io/managed-by=distflow-operator,distflow.io/job-name={name}"

        started = time.monotonic()
        push_train_over_generate(0.6)  # ceil(4 x 0.6) = 3, then ceil(3 x 0.6) = 2 nodes
        _wait_num_nodes(api, keda, name, 2)
        report_figure(f"KEDA: numNodes 2 -> 4 in {scaled_up_s:.1f} s after training took 1.5 x the rollout's time, "
                      f"4 -> 2 in {time.monotonic() - started:.1f} s after it took 0.6 x (HPA sync 2 s, scrape 1 s)")
        _resize_in_place(control_plane, api, k8s_namespace, name, num_nodes=2)
        status = api.wait_phase(name, "Running", timeout_s=90, replicas=2, attempt=1)
        assert api.job(name)["spec"]["cluster"]["numNodes"] == 2 and status["restarts"] == 0
    finally:
        control_plane.kubectl("delete", "-n", k8s_namespace, "--ignore-not-found", "scaledobject", name)
        prometheus.stop()


def _play_leaving_ranks(control_plane, api, namespace: str, name: str) -> None:
    """The workers' part of an in-place shrink, played as kwok runs no runtime: when the ConfigMap asks
    for fewer nodes in place, the running pods of the ranks past that size exit 4, as at a step
    boundary (a grow's joining pods kwok runs by itself). The HPA counts ready pods for a Value
    target, so a size it passes through must lose its pods before it goes on."""
    data = (api.get("configmaps", f"{name}-config") or {}).get("data") or {}
    request = json.loads(data["resize"]) if "resize" in data else {}
    if request.get("inPlace"):
        for pod in api.live_pods(name, phase="Running"):
            if int(pod["metadata"]["labels"]["distflow.io/node-rank"]) >= request["numNodes"]:
                control_plane.set_pod_phase(namespace, pod["metadata"]["name"], "Failed", exit_code=4)


def _resize_in_place(control_plane, api, namespace: str, name: str, num_nodes: int) -> None:
    """Play the in-place resizes until the gang runs at ``num_nodes``."""
    def settled() -> bool:
        _play_leaving_ranks(control_plane, api, namespace, name)
        status = api.status(name)
        return status.get("attemptNodes") == num_nodes and "resizing" not in status
    wait_for(settled, 90, 1.0, what=lambda: f"the gang resized in place to {num_nodes} ({api.status(name)})")


def _hpa(control_plane, namespace: str, name: str) -> dict | None:
    code, body = control_plane.request(
        "GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/keda-hpa-{name}")
    return body if code == 200 else None


def _quantity(text: str) -> float:
    """A resource.Quantity as the metrics API writes it: plain or milli ("224", "224500m")."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _external_value(control_plane, keda: Keda, path: str, expected: float) -> float:
    """The external metric's value once it reads ``expected`` (Prometheus scrapes every second)."""
    def value() -> float | None:
        code, body = control_plane.request("GET", path)
        items = (body.get("items") or []) if code == 200 else []
        return _quantity(items[0]["value"]) if items else None
    wait_for(lambda: value() == expected, 60, 1.0,
             what=lambda: (f"{path} = {expected} (now {control_plane.request('GET', path)}; "
                           f"operator: {keda.log_tail('keda-operator', 15)})"))
    return value()


def _wait_num_nodes(api, keda: Keda, name: str, num_nodes: int) -> None:
    def reached() -> bool:
        _play_leaving_ranks(api.cp, api, api.ns, name)
        return api.job(name)["spec"]["cluster"]["numNodes"] == num_nodes
    wait_for(reached, SCALE_TIMEOUT_S, 1.0,
             what=lambda: (f"spec.cluster.numNodes == {num_nodes} (now {api.job(name)['spec']['cluster']}; HPA "
                           f"{_hpa(api.cp, api.ns, name)}; adapter: {keda.log_tail('keda-adapter', 10)})"))
