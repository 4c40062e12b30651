"""The documented upgrade path with a CRD that changed: running jobs survive it.

The "previous release" is this chart with a CRD that lacks the pod-template
fields added since (``OLD_CRD_LACKS``). On a cluster that has it, a job runs;
then the upgrade exactly as docs/operations.md says: the new CRD by
server-side apply, then ``helm upgrade`` and the operator replaced. The job's
pods are the same pods afterwards (same uids, same attempt), the job finishes,
and the new fields work. ``helm get manifest`` shows why the CRD step is
needed: Helm does not track the chart's crds/ at all.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from distflow_operator import CRD_NAME
from tests.controlplane.cluster import free_port
from tests.operator._helpers import Api, crd, example_job, wait_for  # noqa: F401  (crd: a fixture)
from tests.operator.test_helm import (  # noqa: F401  (fixtures)
    CHART, cluster_helm, helm_binary, http_get, operator_process, stop,
)

pytestmark = pytest.mark.operator

OLD_CRD_LACKS = ("securityContext", "shmSize")
"""spec.template fields the previous release's CRD did not have."""


def write_old_chart(directory: Path) -> Path:
    """A copy of the chart whose crds/ lacks OLD_CRD_LACKS (JSON: a YAML that Go reads as written)."""
    chart = directory / "distflow-old"
    shutil.copytree(CHART, chart)
    crd_file = chart / "crds" / f"{CRD_NAME}.yaml"
    from distflow_operator.crdgen import build_crd

    crd = build_crd()
    template = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["template"]
    for name in OLD_CRD_LACKS:
        del template["properties"][name]
    crd_file.write_text(json.dumps(crd))
    return chart


def accepts_shm_size(api: Api) -> bool:
    """Does the served schema know spec.template.shmSize? (a strict server-side dry run)"""
    doc = example_job("probe", template={"shmSize": "1Gi"})
    status, _ = api.cp.request("POST", f"{api.jobs}?fieldValidation=Strict&dryRun=All", doc)
    return status == 201


def apply_crds(control_plane, chart: Path) -> None:
    out = control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(chart / "crds"))
    assert out.returncode == 0 and CRD_NAME in out.stdout, out.stderr


def test_jobs_survive_the_documented_crd_upgrade(control_plane, crd, cluster_helm, k8s_namespace, tmp_path):
    release, ns, api = f"up-{uuid.uuid4().hex[:6]}", k8s_namespace, Api(control_plane, k8s_namespace)
    old_chart = write_old_chart(tmp_path)
    # The cluster as the previous release left it. replace, not apply: other managers own the
    # new fields, and server-side apply removes only fields that no other manager owns.
    out = control_plane.kubectl("replace", "-f", str(old_chart / "crds"))
    assert out.returncode == 0, out.stderr
    proc = None
    try:
        wait_for(lambda: not accepts_shm_size(api), 30, what="the old CRD served")
        values = ["--set", f"watchNamespaces={{{ns}}}", "--set", f"metrics.port={free_port()}",
                  "--set", f"livenessPort={free_port()}", "--set", "operator.resyncInterval=2"]
        cluster_helm("install", release, str(old_chart), "-n", ns, "--wait", "--timeout=180s", *values)
        proc = start_operator(control_plane, ns, release, tmp_path / "old")
        assert api.create_job(example_job("up-job"))[0] == 201
        before = {p["metadata"]["name"]: p["metadata"]["uid"]
                  for p in api.wait_running_gang("up-job", attempt=1, num_nodes=2, timeout_s=60)}
        status, body = api.create_job(example_job("new-job", template={"shmSize": "2Gi"}))
        assert status in (400, 422) and 'unknown field "spec.template.shmSize"' in body["message"], body

        apply_crds(control_plane, CHART)  # docs/operations.md, "Upgrade": the CRD first ...
        wait_for(lambda: accepts_shm_size(api), 30, what="the new CRD served")
        cluster_helm("upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values", "--wait", "--timeout=180s")
        stop(proc)  # ... then the operator is replaced (it gives its Lease up as it stops)
        proc = start_operator(control_plane, ns, release, tmp_path / "new")

        job = api.job("up-job")
        assert job["spec"]["template"]["securityContext"]["runAsNonRoot"] is True  # defaulted on read
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.live_pods("up-job", attempt=1)}
        assert after == before
        assert api.wait_phase("up-job", "Running")["restarts"] == 0
        assert api.create_job(example_job("new-job", template={"shmSize": "2Gi"}))[0] == 201
        pod = api.wait_running_gang("new-job", attempt=1, num_nodes=2, timeout_s=60)[0]
        shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
        for name in before:
            control_plane.set_pod_phase(ns, name, "Succeeded")
        assert api.wait_phase("up-job", "Succeeded", timeout_s=60)["restarts"] == 0
        assert {p["metadata"]["uid"] for p in api.pods("up-job")} == set(before.values())
        manifest = cluster_helm("get", "manifest", release, "-n", ns).stdout
        assert "kind: Deployment" in manifest and "CustomResourceDefinition" not in manifest
    finally:
        if proc is not None:
            stop(proc)
        cluster_helm("uninstall", release, "-n", ns, "--wait", "--timeout=120s", check=False)
        apply_crds(control_plane, CHART)  # other tests share the API server


def start_operator(control_plane, ns: str, release: str, workdir: Path):
    """The release's Deployment run here, as test_helm does; waits for its liveness endpoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    _, deployment = control_plane.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release}-distflow",
                                          expect=(200,))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    liveness = next(a.split("=", 1)[1] for a in args if a.startswith("--liveness-port="))
    proc = operator_process(control_plane, deployment, ns, workdir)
    wait_for(lambda: http_get(f"http://127.0.0.1:{liveness}/healthz")[0] == 200, 60, what="operator up")
    return proc
