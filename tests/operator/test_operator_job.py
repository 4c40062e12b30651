"""An RLPostTrainJob on a real API server: children, status, printer columns, progress,
gang restart, maxRestarts, suspend/resume, deletion, operator restart. The operator runs
in-process with a ServiceAccount token bound to distflow_operator.rbac.OPERATOR_RULES."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.request

import pytest
import yaml

from distflow.spec import load_job_spec, spec_from_manifest
from distflow_operator.observed import parse_time
from tests.controlplane.cluster import free_port
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    EXAMPLE, api, crd, example_job, kubectl_get_rljob, operator, operator_kubeconfig_path,
    operator_running, wait_for,
)

pytestmark = pytest.mark.operator


def env_of(pod) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_kubectl_apply_example_creates_children_and_reaches_running(control_plane, k8s_namespace, api,
                                                                    operator):
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    job = api.job("grpo-tiny")
    uid = job["metadata"]["uid"]
    assert job["spec"]["rollout"]["temperature"] == 1.0  # the API server applied the model's defaults

    pods = api.wait_running_gang("grpo-tiny", attempt=1, num_nodes=2)
    for rank, pod in enumerate(pods):
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["name"] == f"grpo-tiny-node-{rank}"
        assert meta["ownerReferences"] == [{"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob",
                                            "name": "grpo-tiny", "uid": uid, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"]["distflow.io/node-rank"] == str(rank)
        assert meta["labels"]["distflow.io/attempt"] == "1"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "distflow-operator"
        assert (spec["hostname"], spec["subdomain"]) == (f"grpo-tiny-node-{rank}", "grpo-tiny")
        assert spec["nodeName"] in control_plane.node_names  # scheduled onto a fake GPU node
        env = env_of(pod)
        assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("2", str(rank), "1")
        assert env["MASTER_ADDR"] == f"grpo-tiny-node-0.grpo-tiny.{k8s_namespace}.svc"
        assert (env["MASTER_PORT"], env["WORLD_SIZE"], env["DISTFLOW_ATTEMPT"]) == ("29500", "2", "1")
        resources = spec["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "1" and resources["requests"]["cpu"] == "1"

    config = api.get("configmaps", "grpo-tiny-config")
    assert config["metadata"]["ownerReferences"][0]["uid"] == uid
    assert spec_from_manifest(yaml.safe_load(config["data"]["spec.yaml"])) == load_job_spec(EXAMPLE)
    service = api.get("services", "grpo-tiny")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True

    status = api.wait_phase("grpo-tiny", "Running", readyNodes=2)
    assert (status["nodes"], status["attempt"], status["restarts"]) == ("2/2", 1, 0)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Ready"]["observedGeneration"] == job["metadata"]["generation"]
    columns = kubectl_get_rljob(control_plane, k8s_namespace, "grpo-tiny")
    assert list(columns) == ["NAME", "PHASE", "NODES", "STEP", "TOKENS/S", "RESTARTS", "AGE"]
    assert (columns["PHASE"], columns["NODES"], columns["RESTARTS"]) == ("Running", "2/2", "0")
    reasons = [e["reason"] for e in api.events("grpo-tiny")]
    assert "CreatedNodePods" in reasons and "AllNodesRunning" in reasons
    meta = api.job("grpo-tiny")["metadata"]
    assert not meta.get("finalizers")  # deletable with or without a running operator
    assert not [k for k in meta.get("annotations", {}) if "kopf" in k]  # kopf writes no bookkeeping


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (http.server API)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_progress_scraped_from_node_0_fills_step_and_tokens_columns(control_plane, k8s_namespace, api,
                                                                    operator_kubeconfig_path):
    port = free_port()
    _Metrics.body = (b'distflow_step{job_name="p",node="0"} 5\n'
                     b'distflow_throughput_tokens_per_second{job_name="p",node="0"} 321.5\n')
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with operator_running(operator_kubeconfig_path, k8s_namespace, PROGRESS_INTERVAL="0.3"):
            api.create_job(example_job("progress", trainer={"metricsPort": port}))
            api.wait_phase("progress", "Running")
            # kwok pods have unroutable IPs: point node 0 at this machine, as a kubelet would report it.
            control_plane.request(
                "PATCH", f"/api/v1/namespaces/{k8s_namespace}/pods/progress-node-0/status",
                {"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}},
                content_type="application/merge-patch+json", expect=(200,))
            status = wait_for(lambda: (s := api.status("progress")).get("progress", {}).get("step") == 5 and s,
                              20, what="progress.step = 5")
            assert status["progress"] == {"step": 5, "totalSteps": 3, "tokensPerSecond": 321.5}
            columns = kubectl_get_rljob(control_plane, k8s_namespace, "progress")
            assert (columns["STEP"], columns["TOKENS/S"]) == ("5", "321.5")
    finally:
        server.shutdown()


def test_failed_node_restarts_the_gang_then_max_restarts_fails_the_job(control_plane, k8s_namespace, api,
                                                                       operator):
    api.create_job(example_job("flaky", runPolicy={"maxRestarts": 1, "backoffSeconds": 2}))
    first = api.wait_running_gang("flaky", attempt=1, num_nodes=2)
    control_plane.set_pod_phase(k8s_namespace, "flaky-node-1", "Failed", exit_code=1)

    second = api.wait_running_gang("flaky", attempt=2, num_nodes=2)
    assert {p["metadata"]["uid"] for p in second}.isdisjoint(p["metadata"]["uid"] for p in first)
    assert [env_of(p)["DISTFLOW_ATTEMPT"] for p in second] == ["2", "2"]
    status = api.wait_phase("flaky", "Running", attempt=2)
    assert status["restarts"] == 1
    waited = parse_time(second[0]["metadata"]["creationTimestamp"]) - parse_time(status["lastRestartTime"])
    assert waited.total_seconds() >= 2  # runPolicy.backoffSeconds before the first restart
    restart = next(e for e in api.events("flaky") if e["reason"] == "NodeFailed")
    assert restart["type"] == "Warning" and "flaky-node-1 failed" in restart["message"]

    control_plane.set_pod_phase(k8s_namespace, "flaky-node-0", "Failed", exit_code=137)
    status = api.wait_phase("flaky", "Failed")
    assert status["reason"] == "MaxRestartsExceeded"
    assert "runPolicy.maxRestarts=1" in status["message"] and "flaky-node-0" in status["message"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Failed"] == "True"
    wait_for(lambda: not api.live_pods("flaky", phase="Running"), 15, what="running pods deleted")
    time.sleep(1.0)  # a finished job never gets children again
    assert not api.live_pods("flaky", phase="Running") and not api.live_pods("flaky", attempt=3)
    assert kubectl_get_rljob(control_plane, k8s_namespace, "flaky")["PHASE"] == "Failed"


def test_invalid_config_exit_code_fails_fast_without_restart(control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("badcfg"))
    api.wait_running_gang("badcfg", attempt=1, num_nodes=2)
    control_plane.set_pod_phase(k8s_namespace, "badcfg-node-0", "Failed", exit_code=2)
    status = api.wait_phase("badcfg", "Failed")
    assert (status["reason"], status["restarts"], status["attempt"]) == ("InvalidConfig", 0, 1)


def test_suspend_deletes_pods_resume_recreates_them_with_template_edits(control_plane, k8s_namespace, api,
                                                                        operator):
    api.create_job(example_job("pausable"))
    api.wait_running_gang("pausable", attempt=1, num_nodes=2)
    status, body = api.patch_job("pausable", {"spec": {"template": {"nodeSelector": {"kubernetes.io/os": "linux"}}}})
    assert status == 422 and "may change only while the job is suspended" in body["message"]

    assert api.patch_job("pausable", {"spec": {"runPolicy": {"suspend": True}}})[0] == 200
    api.wait_phase("pausable", "Suspended")
    wait_for(lambda: not api.pods("pausable"), 20, what="pods deleted")
    assert api.get("configmaps", "pausable-config") is not None  # the job and its config stay
    edit = {"spec": {"template": {"nodeSelector": {"kubernetes.io/os": "linux"}}}}
    assert api.patch_job("pausable", edit)[0] == 200

    assert api.patch_job("pausable", {"spec": {"runPolicy": {"suspend": False}}})[0] == 200
    pods = api.wait_running_gang("pausable", attempt=2, num_nodes=2)
    assert all(p["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"} for p in pods)
    status = api.wait_phase("pausable", "Running", attempt=2)
    assert status["restarts"] == 0
    assert "Resumed" in [e["reason"] for e in api.events("pausable")]


def test_operator_restart_mid_job_creates_no_duplicates_and_catches_up(control_plane, k8s_namespace, api,
                                                                       operator_kubeconfig_path):
    with operator_running(operator_kubeconfig_path, k8s_namespace):
        api.create_job(example_job("steady"))
        before = api.wait_running_gang("steady", attempt=1, num_nodes=2)
        api.wait_phase("steady", "Running")
    with operator_running(operator_kubeconfig_path, k8s_namespace):
        time.sleep(2.0)  # the new operator lists everything and reconciles
        after = api.live_pods("steady")
        assert [p["metadata"]["uid"] for p in after] == [p["metadata"]["uid"] for p in before]
        assert api.status("steady")["attempt"] == 1
    created = [e for e in api.events("steady") if e["reason"] == "CreatedNodePods"]
    assert len(created) == 1

    # A node fails while no operator runs; the next one notices from the pod's status alone.
    control_plane.set_pod_phase(k8s_namespace, "steady-node-0", "Failed", exit_code=1)
    with operator_running(operator_kubeconfig_path, k8s_namespace):
        pods = api.wait_running_gang("steady", attempt=2, num_nodes=2)
        assert len(api.pods("steady")) == 2 and len(pods) == 2
        assert api.wait_phase("steady", "Running", attempt=2)["restarts"] == 1


def test_liveness_endpoint_answers_while_the_operator_runs(k8s_namespace, operator_kubeconfig_path):
    port = free_port()
    with operator_running(operator_kubeconfig_path, k8s_namespace, liveness_port=port):
        body = wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz"), 15, what="healthz")
        assert '"jobs"' in body


def test_deleting_the_job_garbage_collects_children_and_metric_series(control_plane, k8s_namespace, api,
                                                                      operator_kubeconfig_path):
    port = free_port()
    with operator_running(operator_kubeconfig_path, k8s_namespace, METRICS_PORT=str(port)):
        api.create_job(example_job("doomed"))
        api.wait_phase("doomed", "Running")

        def series():
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        assert f'distflow_operator_job_phase{{job_name="doomed",namespace="{k8s_namespace}",phase="Running"}} 1.0' \
            in series()
        api.delete_job("doomed")
        # The garbage collector learns a new CRD's kind on its 30 s discovery resync.
        wait_for(lambda: not api.pods("doomed") and api.get("configmaps", "doomed-config") is None
                 and api.get("services", "doomed") is None, 75, 0.5, what="children collected")
        wait_for(lambda: 'job_name="doomed"' not in series(), 10, what="job series gone")
        assert 'distflow_operator_jobs{phase="Running"} 0.0' in series()


def _get(url: str) -> str | None:
    try:
        return urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return None


def test_success_is_terminal_and_ttl_deletes_the_finished_job(control_plane, k8s_namespace, api, operator):
    api.create_job(example_job("quick", runPolicy={"ttlSecondsAfterFinished": 2}))
    api.wait_running_gang("quick", attempt=1, num_nodes=2)
    for rank in (0, 1):
        control_plane.set_pod_phase(k8s_namespace, f"quick-node-{rank}", "Succeeded")
    status = api.wait_phase("quick", "Succeeded")
    assert status["reason"] == "Completed" and "completionTime" in status
    assert len(api.pods("quick")) == 2  # finished pods stay for their logs until the TTL
    wait_for(lambda: api.job("quick") is None, 20, 0.2, what="job deleted by its TTL")


def test_active_deadline_fails_a_running_job_and_frees_its_nodes(k8s_namespace, api, operator):
    api.create_job(example_job("bounded", runPolicy={"activeDeadlineSeconds": 2}))
    api.wait_running_gang("bounded", attempt=1, num_nodes=2)
    status = api.wait_phase("bounded", "Failed", timeout_s=20)
    assert status["reason"] == "DeadlineExceeded"
    assert "runPolicy.activeDeadlineSeconds=2" in status["message"]
    wait_for(lambda: not api.live_pods("bounded"), 20, what="pods deleted")
