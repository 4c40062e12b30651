"""e2e: `kubectl apply` an RLPostTrainJob; the pods the operator creates run as local processes and train.

The control plane is real (kube-apiserver, etcd, scheduler, kwok fake GPU nodes),
with kwok told to leave pod phases alone: `LocalKubelet` reads each bound pod
back from the API server, starts its container command with the pod's env and
ConfigMap volume as a local process, and reports Running/Ready/exit into the pod
status. The operator runs in-process with least-privilege credentials and scrapes
node 0's metrics through the pod IP, as in a cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distflow import sample_ids
from tests.controlplane.cluster import ControlPlane
from tests.dist._jobs import bit_identical, final_checkpoint
from tests.e2e.harness import (
    JOB_TIMEOUT_S, apply_job, e2e_control_plane, job_doc, job_namespace, trained_steps, wait_finished,
)
from tests.e2e.kubelet import LocalKubelet
from tests.operator._helpers import Api, dump, operator_kubeconfig, operator_running, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(control_plane_bin_dir: Path) -> Iterator[ControlPlane]:
    """A control plane of this module's own whose pods the local kubelet runs."""
    with e2e_control_plane(control_plane_bin_dir) as cp:
        yield cp


@pytest.fixture
def namespace(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    with job_namespace(cluster, request.node.name[5:25]) as name:
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
    with job_namespace(cluster, "uninterrupted") as namespace:
        api = Api(cluster, namespace)
        kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
        with (operator_running(kubeconfig, namespace, PROGRESS_INTERVAL="0.3"),
              LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
            dirs = _apply(cluster, namespace, tmp_path, UNINTERRUPTED, RESTART_STEPS)
            scraped: set[int] = set()
            status = wait_finished(api, UNINTERRUPTED, kubelet, scraped=scraped)
            return Finished(status, dirs, _exits(kubelet), api.pods(UNINTERRUPTED), scraped)


UNINTERRUPTED = "e2e-grpo"


def _apply(cluster: ControlPlane, namespace: str, tmp_path: Path, name: str, total_steps: int,
           model: str = "tiny") -> dict[str, Path]:
    apply_job(cluster, namespace, job_doc(name, tmp_path, total_steps, model))
    return {"logs": tmp_path / "logs", "checkpoints": tmp_path / "checkpoints"}


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
    assert trained_steps(uninterrupted.dirs["logs"]) == list(range(1, total + 1))
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
        status = wait_finished(api, name, kubelet)

    assert (status["attempt"], status["restarts"]) == (2, 1), dump(status)
    assert status["progress"]["step"] == total and status["progress"]["lastCheckpointStep"] >= 1, dump(status)
    exits = _exits(kubelet)
    assert ("1", f"{name}-node-1", 137) in exits, exits
    assert [e for e in exits if e[0] == "2"] == [("2", f"{name}-node-0", 0), ("2", f"{name}-node-1", 0)]
    restarts = [e for e in api.events(name) if e["reason"] == "NodeFailed"]
    assert restarts and "exit code 137" in restarts[0]["message"], dump(api.events(name))
    steps = trained_steps(dirs["logs"])
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
        status = wait_finished(api, name, kubelet, phase="Failed")

    # Exit code 2 + the termination message `distflow node` wrote, carried by the pod status into the job's.
    assert (status["reason"], status["attempt"], status["restarts"]) == ("InvalidConfig", 1, 0), dump(status)
    assert "exit code 2" in status["message"] and "spec.model.path" in status["message"], status["message"]
    assert "/models/missing" in status["message"]
    assert 2 in [e.exit_code for e in kubelet.exits] and {e.attempt for e in kubelet.exits} == {"1"}
