"""Operator-tier helpers: the CRD installed once, the operator running in-process
(kopf's KopfRunner) with a least-privilege ServiceAccount token, and small API helpers.

Import the fixtures into a test module with
``from tests.operator._helpers import crd, operator  # noqa: F401``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from distflow_operator import API_GROUP, API_VERSION, CRD_NAME, KIND, PLURAL
from distflow_operator.rbac import KOPF_DISCOVERY_RULES, LEADER_ELECTION_RULES, OPERATOR_RULES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob.yaml"
CRD_FILE = REPO / "crds" / f"{CRD_NAME}.yaml"
OPERATOR_ROLE = "distflow-operator-test"
DISCOVERY_ROLE = "distflow-operator-test-discovery"
LEADER_ROLE = "distflow-operator-test-leader-election"
OPERATOR_SA = "distflow-operator"


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.1,
             what: str | Callable[[], str] = "") -> Any:
    """Poll until predicate() is truthy; return its value or raise TimeoutError.

    ``what`` names the condition; a callable is called at the timeout (to say what was seen then).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not met within {timeout_s}s: {(what() if callable(what) else what) or predicate}")
        time.sleep(interval_s)


def example_job(name: str | None = None, **spec_updates: Any) -> dict[str, Any]:
    """examples/rljob.yaml, optionally renamed and with spec sections merged in."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    if name:
        doc["metadata"]["name"] = name
    for key, value in spec_updates.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **copy.deepcopy(value)}
        else:
            doc["spec"][key] = copy.deepcopy(value)
    return doc


class Api:
    """The calls a test makes in one namespace, as the cluster admin."""

    def __init__(self, control_plane: Any, namespace: str):
        self.cp, self.ns = control_plane, namespace
        self.jobs = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"

    def create_job(self, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST with strict field validation (what kubectl apply does): unknown fields are errors."""
        return self.cp.request("POST", f"{self.jobs}?fieldValidation=Strict", doc)

    def job(self, name: str) -> dict[str, Any] | None:
        status, body = self.cp.request("GET", f"{self.jobs}/{name}")
        return body if status == 200 else None

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def patch_job(self, name: str, patch: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.cp.request("PATCH", f"{self.jobs}/{name}", patch,
                               content_type="application/merge-patch+json")

    def delete_job(self, name: str) -> None:
        self.cp.request("DELETE", f"{self.jobs}/{name}", expect=(200, 202, 404))

    def list(self, kind_path: str, selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        _, body = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/{kind_path}{query}", expect=(200,))
        return body["items"]

    def pods(self, job: str) -> list[dict[str, Any]]:
        pods = self.list("pods", f"distflow.io/job-name={job}")
        return sorted(pods, key=lambda p: p["metadata"]["name"])

    def live_pods(self, job: str, attempt: int | None = None, phase: str | None = None) -> list[dict[str, Any]]:
        """Pods of the job without a deletionTimestamp (optionally of one attempt and phase)."""
        out = []
        for pod in self.pods(job):
            labels = pod["metadata"]["labels"]
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if attempt is not None and labels.get("distflow.io/attempt") != str(attempt):
                continue
            if phase is not None and pod.get("status", {}).get("phase") != phase:
                continue
            out.append(pod)
        return out

    def get(self, kind_path: str, name: str) -> dict[str, Any] | None:
        status, body = self.cp.request("GET", f"/api/v1/namespaces/{self.ns}/{kind_path}/{name}")
        return body if status == 200 else None

    def events(self, job: str) -> list[dict[str, Any]]:
        return [e for e in self.list("events") if e["involvedObject"].get("name") == job]

    def wait_phase(self, job: str, phase: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        def ready():
            status = self.status(job)
            return status if status.get("phase") == phase and all(
                status.get(k) == v for k, v in fields.items()) else None
        return wait_for(ready, timeout_s, what=lambda: f"{job} phase {phase} {fields} (now {self.status(job)})")

    def wait_running_gang(self, job: str, attempt: int, num_nodes: int, timeout_s: float = 30.0) -> list[dict]:
        return wait_for(lambda: (p := self.live_pods(job, attempt, "Running")) and len(p) == num_nodes and p,
                        timeout_s, what=lambda: f"{num_nodes} running pods of {job} attempt {attempt} (now "
                        f"{self.pod_summary(job)}; status {self.status(job)})")

    def pod_summary(self, job: str) -> list[tuple[str, str, str, str, bool]]:
        """(name, attempt, node, phase, deleting) of each of the job's pods."""
        return [(p["metadata"]["name"], p["metadata"]["labels"].get("distflow.io/attempt", "?"),
                 p["spec"].get("nodeName", ""), p.get("status", {}).get("phase", "?"),
                 bool(p["metadata"].get("deletionTimestamp"))) for p in self.pods(job)]


@pytest.fixture(scope="session")
def crd(control_plane) -> str:
    """The generated CRD applied with kubectl and Established, plus the operator's ClusterRole."""
    out = control_plane.kubectl("apply", "-f", str(CRD_FILE))
    assert out.returncode == 0, out.stderr
    wait_for(lambda: control_plane.kubectl("wait", "--for=condition=Established", "--timeout=20s",
                                           f"crd/{CRD_NAME}").returncode == 0, 30, what="CRD Established")
    for name, rules in ((OPERATOR_ROLE, OPERATOR_RULES), (DISCOVERY_ROLE, KOPF_DISCOVERY_RULES),
                        (LEADER_ROLE, LEADER_ELECTION_RULES)):
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": name}, "rules": rules}
        control_plane.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role,
                              expect=(201, 409))
    # Discovery caches of the apiserver need a moment before the new resource is served.
    wait_for(lambda: control_plane.kubectl("get", "rljob", "-A").returncode == 0, 30, what="rljob served")
    wait_admission_maps_the_kind(control_plane)
    return CRD_NAME


ADMISSION_PROBE_USER = "distflow-admission-probe"


def wait_admission_maps_the_kind(control_plane: Any, timeout_s: float = 45.0) -> None:
    """Wait until OwnerReferencesPermissionEnforcement admits children of an RLPostTrainJob.

    That admission plugin maps an owner's kind through its own discovery cache,
    which kube-apiserver refreshes every 30 s: for up to 30 s after a CRD is
    installed, a child with ``blockOwnerDeletion`` is refused (403 "cannot find
    RESTMapping") to anyone short of cluster admin. The operator rides that out
    (a 403 is retried for runPolicy.podErrorGraceSeconds); waiting here keeps
    every test's time budget free of it, whichever test runs first.
    """
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": ADMISSION_PROBE_USER},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_ROLE},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": ADMISSION_PROBE_USER}]}
    control_plane.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding,
                          expect=(201, 409))
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "admission-probe", "namespace": "default", "ownerReferences": [{
            "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": "probe",
            "uid": "00000000-0000-0000-0000-000000000000", "controller": True, "blockOwnerDeletion": True}]}}

    def admitted() -> bool:
        out = control_plane.kubectl("create", "--dry-run=server", f"--as={ADMISSION_PROBE_USER}", "-f", "-",
                                    input=json.dumps(child))
        assert out.returncode == 0 or "cannot find RESTMapping" in out.stderr, out.stderr
        return out.returncode == 0

    wait_for(admitted, timeout_s, 1.0, what="admission maps RLPostTrainJob (its discovery refreshes every 30 s)")


def operator_kubeconfig(control_plane: Any, namespace: str, directory: Path) -> Path:
    """A kubeconfig for a fresh ServiceAccount bound to OPERATOR_RULES and LEADER_ELECTION_RULES in
    `namespace` only, and to the read-only KOPF_DISCOVERY_RULES cluster-wide."""
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_SA}},
                          expect=(201, 409))
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": OPERATOR_SA},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_ROLE},
               "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": namespace}]}
    leader = {**binding, "metadata": {"name": f"{OPERATOR_SA}-leader-election"},
              "roleRef": {**binding["roleRef"], "name": LEADER_ROLE}}
    for role_binding in (binding, leader):
        control_plane.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
                              role_binding, expect=(201, 409))
    discovery = {**binding, "kind": "ClusterRoleBinding", "metadata": {"name": f"{DISCOVERY_ROLE}-{namespace}"},
                 "roleRef": {**binding["roleRef"], "name": DISCOVERY_ROLE}}
    control_plane.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", discovery,
                          expect=(201, 409))
    token = control_plane.make_token_for_serviceaccount(namespace, OPERATOR_SA)
    return control_plane.write_kubeconfig(directory / f"operator-{namespace}.kubeconfig", token,
                                          user=f"system:serviceaccount:{namespace}:{OPERATOR_SA}")


@contextmanager
def operator_running(kubeconfig: Path, namespace: str, *, liveness_port: int | None = None,
                     **env: str) -> Iterator[Any]:
    """The operator in this process (kopf's KopfRunner), watching one namespace.

    ``env``: extra DISTFLOW_OPERATOR_* settings, e.g. PROGRESS_INTERVAL="0.3".
    """
    from kopf.testing import KopfRunner

    settings = {"KUBECONFIG": str(kubeconfig), "DISTFLOW_OPERATOR_RESYNC_INTERVAL": "5",
                **{f"DISTFLOW_OPERATOR_{k}": v for k, v in env.items()}}
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    args = ["run", "--standalone", "--namespace", namespace, "-m", "distflow_operator.handlers"]
    if liveness_port:
        args += ["--liveness", f"http://127.0.0.1:{liveness_port}/healthz"]
    errors = _ErrorLog()
    loggers = [logging.getLogger(name) for name in ("distflow_operator", "kopf")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with KopfRunner(args, timeout=30) as runner:
            yield runner
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert runner.exception is None, runner.output
    assert not errors.records, "operator logged errors:\n" + "\n".join(errors.records)


class _ErrorLog(logging.Handler):
    """Collects ERROR records: a reconcile that raised, a handler kopf saw fail."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # kopf's API client logs each retried request at ERROR ("Request attempt #1/9 failed; will
        # retry"): a dropped connection it then recovers from, not an operator failure.
        if " will retry" in record.getMessage() or " will re-authenticate" in record.getMessage():
            return
        self.records.append(self.format(record))


@pytest.fixture
def operator_kubeconfig_path(control_plane, crd, k8s_namespace, tmp_path) -> Path:
    return operator_kubeconfig(control_plane, k8s_namespace, tmp_path)


@pytest.fixture
def operator(operator_kubeconfig_path, k8s_namespace) -> Iterator[Any]:
    """The operator running for this test's namespace with least-privilege credentials."""
    with operator_running(operator_kubeconfig_path, k8s_namespace) as runner:
        yield runner


@pytest.fixture
def api(control_plane, k8s_namespace) -> Api:
    return Api(control_plane, k8s_namespace)


def kubectl_get_rljob(control_plane: Any, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get rljob NAME` parsed into {COLUMN: value}."""
    out = control_plane.kubectl("get", "rljob", name, "-n", namespace)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    starts = [header.index(col) for col in header.split()]
    cells = [row[a:b].strip() for a, b in zip(starts, starts[1:] + [len(row) + 1], strict=True)]
    return dict(zip(header.split(), cells, strict=True))


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
