"""What the e2e tests and the resize benchmark share: the job manifest, a control plane whose pods
the local kubelet runs (``LocalKubelet``), a namespace per job, and waits on a job's progress.

The control plane is real (kube-apiserver, etcd, scheduler, kwok fake GPU nodes), with kwok told
to leave pod phases alone, so that the kubelet of ``tests.e2e.kubelet`` can play them.
"""

from __future__ import annotations

import contextlib
import json
import re
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from distflow_operator import CRD_NAME
from distflow_operator.rbac import KOPF_DISCOVERY_RULES, OPERATOR_RULES
from tests.controlplane.cluster import ControlPlane
from tests.e2e.kubelet import LocalKubelet
from tests.operator._helpers import CRD_FILE, DISCOVERY_ROLE, OPERATOR_ROLE, Api, dump, wait_for

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
STOPPED = re.compile(r"distflow: stopping after step (\d+) for a resize to (\d+) nodes \(checkpoint saved\)")
REFORMED = re.compile(r"distflow: after step (\d+) the gang re-forms in place at (\d+) nodes")
"""The line rank 0 logs when the gang resizes in place (``distflow.gang_resize``): (step, nodes)."""
"""The line node 0 prints when the gang stops at a step boundary for a resize: (step, new size)."""


@contextlib.contextmanager
def e2e_control_plane(bin_dir: Path, nodes: int = 2) -> Iterator[ControlPlane]:
    """A control plane whose kwok leaves pod phases to the local kubelet, with the CRD and the
    operator's ClusterRoles installed."""
    with ControlPlane(bin_dir, nodes=nodes, pods_become_running=False) as cp:
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
def job_namespace(cluster: ControlPlane, label: str) -> Iterator[str]:
    """A fresh namespace (its default ServiceAccount present), deleted afterwards without waiting."""
    name = f"e2e-{label[:20].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:6]}"
    cluster.request("POST", "/api/v1/namespaces",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, expect=(201,))
    wait_for(lambda: cluster.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200,
             30, what=f"namespace {name} default ServiceAccount")
    yield name
    cluster.request("DELETE", f"/api/v1/namespaces/{name}")


def job_doc(name: str, tmp_path: Path, total_steps: int, model: str = "tiny") -> dict[str, Any]:
    """``JOB_YAML`` as a dict, logging under ``tmp_path/logs`` and checkpointing under
    ``tmp_path/checkpoints``."""
    return yaml.safe_load(JOB_YAML.format(name=name, model=model, total_steps=total_steps,
                                          log_dir=tmp_path / "logs", checkpoint_dir=tmp_path / "checkpoints"))


def apply_job(cluster: ControlPlane, namespace: str, doc: dict[str, Any]) -> None:
    """``kubectl apply`` a job given as a dict."""
    # JSON: kubectl's YAML 1.1 parser would read rollout's bare key n as false.
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc, default=str))
    assert out.returncode == 0, out.stderr


def wait_finished(api: Api, name: str, kubelet: LocalKubelet, timeout_s: float = JOB_TIMEOUT_S,
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


def trained_steps(log_dir: Path) -> list[int]:
    """``training/step`` of every record in ``log_dir/metrics.jsonl``, in file order."""
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [int(record["training/step"]) for record in map(json.loads, lines) if "training/step" in record]


def trained_past(log_dir: Path, step: int):
    """A predicate for ``wait_for``: a step after ``step`` is logged."""
    return lambda: (log_dir / "metrics.jsonl").is_file() and max(trained_steps(log_dir), default=0) > step
