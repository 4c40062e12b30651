"""examples/rayjob.yaml: its distflow config is valid and fits the Ray cluster it asks KubeRay for."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((REPO / "examples" / "rayjob.yaml").read_text())}


def _mounts(pod_spec: dict) -> dict[str, str]:
    """mountPath -> volume name of the pod's first container."""
    return {m["mountPath"]: m["name"] for m in pod_spec["containers"][0]["volumeMounts"]}


def test_entrypoint_runs_the_mounted_config_with_the_ray_launcher(docs):
    job = docs["RayJob"]["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[:2] == ["distflow", "run"] and argv[3:] == ["--ray", "auto"]
    config_dir, config_file = str(Path(argv[2]).parent), Path(argv[2]).name
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volume = next(v for v in head["volumes"] if v["name"] == _mounts(head)[config_dir])
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert config_file in docs["ConfigMap"]["data"]


def test_config_places_one_distflow_node_per_ray_worker_pod(docs):
    spec = parse_spec(yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"]))
    cluster = docs["RayJob"]["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == spec.cluster.num_nodes
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == spec.cluster.procs_per_node
    assert spec.ray.cpus_per_worker * spec.cluster.procs_per_node <= float(group["rayStartParams"]["num-cpus"])


def test_checkpoints_and_logs_are_on_the_volume_every_ray_pod_shares(docs):
    spec = parse_spec(yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"]))
    cluster = docs["RayJob"]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"], cluster["workerGroupSpecs"][0]["template"]["spec"]]
    for pod in pods:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        for path in (spec.checkpoint.dir, spec.trainer.log_dir):
            mount = next(m for m in _mounts(pod) if path.startswith(m + "/"))
            assert claims[_mounts(pod)[mount]] == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_ray_version_is_the_one_the_lock_pins_for_the_ray_extra(docs):
    """The image is built from requirements.lock; KubeRay needs rayVersion to be the image's Ray."""
    pin = re.search(r"^ray==([\d.]+)", (REPO / "requirements.lock").read_text(), re.M)
    assert pin, "requirements.lock pins no ray (the ray extra)"
    assert docs["RayJob"]["spec"]["rayClusterSpec"]["rayVersion"] == pin[1]
