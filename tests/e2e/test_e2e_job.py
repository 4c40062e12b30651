"""e2e: `kubectl apply` an RLPostTrainJob; the pods the operator creates run as local processes and train.

The control plane is real (kube-apiserver, etcd, scheduler, kwok fake GPU nodes),
with kwok told to leave pod phases alone: `LocalKubelet` reads each bound pod
back from the API server, starts its container command with the pod's env and
ConfigMap volume as a local process, and reports Running/Ready/exit into the pod
status. The operator runs in-process with least-privilege credentials and scrapes
node 0's metrics through the pod IP, as in a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distflow import sample_ids
from distflow_operator import CRD_NAME
from distflow_operator.rbac import KOPF_DISCOVERY_RULES, OPERATOR_RULES
from tests.controlplane.cluster import ControlPlane
from tests.dist._jobs import bit_identical, final_checkpoint
from tests.e2e.kubelet import LocalKubelet
from tests.operator._helpers import (
    CRD_FILE, DISCOVERY_ROLE, OPERATOR_ROLE, Api, dump, operator_kubeconfig, operator_running, wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Block YAML only (str.format fills it); "n" quoted: kubectl reads a bare n as false.
JOB_YAML = textwrap.dedent("""\
    apiVersion: distflow.io/v1alpha1
    kind: RLPostTrainJob
    metadata:
      name: {name}
    spec:
      model:
        path: {model}
      data:
        train:
          path: arithmetic
          size: 64
        trainBatchSize: 2
        maxPromptLength: 48
        maxResponseLength: 4
      rollout:
        "n": 2
      actor:
        microBatchSize: 4
      cluster:
        numNodes: 2
        procsPerNode: 1
        acceleratorsPerNode: 1
        device: cpu
      trainer:
        totalSteps: {total_steps}
        logDir: {log_dir}
        numThreads: 1
      checkpoint:
        dir: {checkpoint_dir}
        saveEverySteps: 1
      runPolicy:
        maxRestarts: 1
        backoffSeconds: 0
      template:
        image: distflow/worker:0.1.0
    """)
JOB_TIMEOUT_S = 300.0
"""Per job, generous: each node imports torch twice (node + worker process) on a shared 2-core host."""


@pytest.fixture(scope="module")
def cluster(control_plane_bin_dir: Path) -> Iterator[ControlPlane]:
    """A control plane of its own whose kwok leaves pod phases to the local kubelet,
    with the CRD and the operator's ClusterRoles installed."""
    with ControlPlane(control_plane_bin_dir, nodes=2, pods_become_running=False) as cp:
        assert cp.kubectl("apply", "-f", str(CRD_FILE)).returncode == 0
        wait_for(lambda: cp.kubectl("wait", "--for=condition=Established", "--timeout=20s",
                                    f"crd/{CRD_NAME}").returncode == 0, 60, what="CRD Established")
        for name, rules in ((OPERATOR_ROLE, OPERATOR_RULES), (DISCOVERY_ROLE, KOPF_DISCOVERY_RULES)):
            cp.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                       {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                        "metadata": {"name": name}, "rules": rules}, expect=(201, 409))
        wait_for(lambda: cp.kubectl("get", "rljob", "-A").returncode == 0, 60, what="rljob served")
        yield cp


@contextlib.contextmanager
def _namespace(cluster: ControlPlane, label: str) -> Iterator[str]:
    name = f"e2e-{label[:20].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:6]}"
    cluster.request("POST", "/api/v1/namespaces",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, expect=(201,))
    wait_for(lambda: cluster.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200,
             30, what=f"namespace {name} default ServiceAccount")
    yield name
    cluster.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def namespace(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    with _namespace(cluster, request.node.name[5:25]) as name:
        yield name


RESTART_STEPS = 3
"""Steps of the job the restart test kills, and of the uninterrupted run it is compared with."""


@dataclasses.dataclass
class Finished:
    """What an uninterrupted job left: its status, directories, node exits, pods and scraped steps."""
    status: dict[str, Any]
    dirs: dict[str, Path]
    exits: list[tuple[str, str, int]]
    pods: list[dict[str, Any]]
    scraped: set[int]


@pytest.fixture(scope="module")
def uninterrupted(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """The restart test's job run to the end with no fault: the reference its parameters are compared with."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    with _namespace(cluster, "uninterrupted") as namespace:
        api = Api(cluster, namespace)
        kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
        with (operator_running(kubeconfig, namespace, PROGRESS_INTERVAL="0.3"),
              LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
            dirs = _apply(cluster, namespace, tmp_path, UNINTERRUPTED, RESTART_STEPS)
            scraped: set[int] = set()
            status = _wait_finished(api, UNINTERRUPTED, kubelet, scraped=scraped)
            return Finished(status, dirs, _exits(kubelet), api.pods(UNINTERRUPTED), scraped)


UNINTERRUPTED = "e2e-grpo"


def _apply(cluster: ControlPlane, namespace: str, tmp_path: Path, name: str, total_steps: int,
           model: str = "tiny") -> dict[str, Path]:
    dirs = {"logs": tmp_path / "logs", "checkpoints": tmp_path / "checkpoints"}
    manifest = JOB_YAML.format(name=name, model=model, total_steps=total_steps, log_dir=dirs["logs"],
                               checkpoint_dir=dirs["checkpoints"])
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    assert out.returncode == 0, out.stderr
    return dirs


def _wait_finished(api: Api, name: str, kubelet: LocalKubelet, timeout_s: float = JOB_TIMEOUT_S,
                   phase: str = "Succeeded", scraped: set[int] | None = None) -> dict[str, Any]:
    """The job's status once it is in ``phase``; fails early (with the node logs) on the other
    terminal phase or a dead kubelet. ``scraped`` collects progress.step values seen while Running."""
    def finished():
        if kubelet.error is not None:
            raise AssertionError(f"local kubelet failed: {kubelet.error!r}")
        try:
            status = api.status(name)
        except OSError:  # a call timed out on the loaded host: ask again
            return None
        if scraped is not None and status.get("phase") == "Running" and "step" in status.get("progress", {}):
            scraped.add(status["progress"]["step"])
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    try:
        status = wait_for(finished, timeout_s, interval_s=0.5, what=f"{name} finished")
    except TimeoutError as err:
        raise AssertionError(f"{err}; status {dump(api.status(name))}\n{kubelet.log_tails()}") from None
    assert status["phase"] == phase, f"{dump(status)}\n{kubelet.log_tails()}"
    return status


def _steps(log_dir: Path) -> list[int]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [int(record["training/step"]) for record in map(json.loads, lines) if "training/step" in record]


def _exits(kubelet: LocalKubelet) -> list[tuple[str, str, int]]:
    return sorted((e.attempt, e.pod, e.exit_code) for e in kubelet.exits)


def test_job_pods_run_as_local_processes_train_and_the_job_succeeds(uninterrupted):
    name, total, status = UNINTERRUPTED, RESTART_STEPS, uninterrupted.status
    assert (status["attempt"], status["restarts"]) == (1, 0), dump(status)
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == total, dump(status)
    # Progress came from node 0's metrics through its pod IP while it trained (the last
    # step and checkpoint may end between two scrapes; Succeeded itself implies the last step).
    assert uninterrupted.scraped and min(uninterrupted.scraped) >= 1, uninterrupted.scraped
    assert status["progress"]["lastCheckpointStep"] >= 1 and status["progress"]["tokensPerSecond"] > 0
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    assert _steps(uninterrupted.dirs["logs"]) == list(range(1, total + 1))
    assert uninterrupted.exits == [("1", f"{name}-node-0", 0), ("1", f"{name}-node-1", 0)]
    pods = uninterrupted.pods
    assert [p["status"]["phase"] for p in pods] == ["Succeeded", "Succeeded"]
    assert [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods] == [0, 0]
    assert len({p["status"]["podIP"] for p in pods}) == 2


def test_a_crashed_node_restarts_the_gang_which_resumes_from_the_checkpoint(cluster, namespace, tmp_path,
                                                                             uninterrupted):
    name, total = "e2e-restart", RESTART_STEPS
    api = Api(cluster, namespace)
    kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
    with (operator_running(kubeconfig, namespace, PROGRESS_INTERVAL="0.3"),
          LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
        dirs = _apply(cluster, namespace, tmp_path, name, total)
        first = dirs["checkpoints"] / "step_00000001" / "trainer.json"
        wait_for(first.is_file, JOB_TIMEOUT_S, what=f"checkpoint of step 1 ({kubelet.log_tails()})")
        kubelet.kill(f"{name}-node-1")  # SIGKILL, as the OOM killer or a lost node would
        status = _wait_finished(api, name, kubelet)

    assert (status["attempt"], status["restarts"]) == (2, 1), dump(status)
    assert status["progress"]["step"] == total and status["progress"]["lastCheckpointStep"] >= 1, dump(status)
    exits = _exits(kubelet)
    assert ("1", f"{name}-node-1", 137) in exits, exits
    assert [e for e in exits if e[0] == "2"] == [("2", f"{name}-node-0", 0), ("2", f"{name}-node-1", 0)]
    restarts = [e for e in api.events(name) if e["reason"] == "NodeFailed"]
    assert restarts and "exit code 137" in restarts[0]["message"], dump(api.events(name))
    steps = _steps(dirs["logs"])
    # Attempt 2 continued from a checkpoint: step 1 was trained once, every step up to the total was reached.
    assert steps.count(1) == 1 and set(steps) == set(range(1, total + 1)) and steps[-1] == total, steps
    # The gang restart resumed through the checkpoint path the chaos loop checks: the final parameters and
    # optimizer state equal the uninterrupted run's bit for bit, and every step trained the same sample ids.
    resumed = final_checkpoint(dirs["checkpoints"])
    assert bit_identical(resumed, final_checkpoint(uninterrupted.dirs["checkpoints"])), \
        "the restarted job's final parameters/optimizer state differ from the uninterrupted run's"
    assert sample_ids.read(dirs["logs"]) == sample_ids.read(uninterrupted.dirs["logs"])


def test_a_node_that_rejects_its_config_fails_the_job_at_once_with_its_message(cluster, namespace, tmp_path):
    name = "e2e-bad-model"
    api = Api(cluster, namespace)
    kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
    with (operator_running(kubeconfig, namespace),
          LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
        _apply(cluster, namespace, tmp_path, name, 2, model="/models/missing")
        status = _wait_finished(api, name, kubelet, phase="Failed")

    # Exit code 2 + the termination message `distflow node` wrote, carried by the pod status into the job's.
    assert (status["reason"], status["attempt"], status["restarts"]) == ("InvalidConfig", 1, 0), dump(status)
    assert "exit code 2" in status["message"] and "spec.model.path" in status["message"], status["message"]
    assert "/models/missing" in status["message"]
    assert 2 in [e.exit_code for e in kubelet.exits] and {e.attempt for e in kubelet.exits} == {"1"}
