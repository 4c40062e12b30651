"""examples/rayjob.yaml on the real API server with KubeRay's CRDs installed.

The CRDs (ray.io/v1 RayCluster, RayJob, RayService) come from KubeRay's
ray-operator Go module at the version pinned in tests/controlplane/kuberay.env,
fetched and cached by tests/controlplane/fetch_kuberay_crds.sh (.ci/setup --tests runs
it); without them these tests skip, saying so. No KubeRay operator runs: this
proves the manifest is what KubeRay's schema accepts, as `kubectl apply` would
on a cluster with KubeRay, not that KubeRay starts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.controlplane.cluster import ControlPlaneError, run_build_script

pytestmark = [pytest.mark.operator, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rayjob.yaml"
FETCH_SCRIPT = REPO / "tests" / "controlplane" / "fetch_kuberay_crds.sh"
KUBERAY_CRDS = ("rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io")


@pytest.fixture(scope="module")
def kuberay_crds(control_plane):
    try:
        crd_dir = run_build_script(FETCH_SCRIPT, timeout_s=600)
    except (ControlPlaneError, OSError) as err:
        pytest.skip(f"KubeRay CRDs missing: tests/controlplane/fetch_kuberay_crds.sh failed: {err}")
    # Server-side: each CRD is over 262144 bytes, too big for client-side apply's annotation.
    out = control_plane.kubectl("apply", "--server-side", "-f", str(crd_dir))
    assert out.returncode == 0, out.stderr
    out = control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                                *(f"crd/{name}" for name in KUBERAY_CRDS))
    assert out.returncode == 0, out.stderr
    yield
    control_plane.kubectl("delete", "--wait=false", *(f"crd/{name}" for name in KUBERAY_CRDS))


def test_rayjob_example_is_stored_as_written(control_plane, kuberay_crds, k8s_namespace):
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert "rayjob.ray.io/distflow-grpo created" in out.stdout
    got = json.loads(control_plane.kubectl("get", "rayjob", "distflow-grpo", "-n", k8s_namespace,
                                           "-o", "json", check=True).stdout)
    spec = got["spec"]
    assert spec["entrypoint"] == "distflow run /etc/distflow/job.yaml --ray auto"
    assert spec["backoffLimit"] == 2 and spec["shutdownAfterJobFinishes"] is True
    worker = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    assert worker["replicas"] == 2
    # Nothing the schema does not know was pruned: the pod template survives whole.
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/distflow", "/shared", "/dev/shm"}


def test_rayjob_with_a_misspelt_field_is_rejected(control_plane, kuberay_crds, k8s_namespace):
    doc = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "typo"},
           "spec": {"entrypoint": "distflow run job.yaml --ray auto", "shutdownAfterJobFinish": True}}
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=json.dumps(doc))
    assert out.returncode != 0
    assert 'unknown field "spec.shutdownAfterJobFinish"' in out.stderr
