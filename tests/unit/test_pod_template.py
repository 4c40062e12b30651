"""The typed pod template and Kueue metadata on node pods, value by value."""

from __future__ import annotations

import pytest

from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec
from distflow_operator import render
from distflow_operator.observed import job_view
from distflow_operator.render import JobRef

pytestmark = pytest.mark.unit

OWNER = JobRef(name="grpo", namespace="team-a", uid="0b6c-uid")


def make_spec(template=None, num_nodes=2):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8},
                       "cluster": {"numNodes": num_nodes, "acceleratorsPerNode": 8},
                       "template": template or {}})


def test_default_node_pod_meets_pod_security_restricted():
    pod = render.build_node_pod(make_spec(), OWNER, rank=0, attempt=1)
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": False,
        "capabilities": {"drop": ["ALL"]}}
    assert "hostNetwork" not in pod["spec"] and "imagePullSecrets" not in pod["spec"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == render.SHM_VOLUME)
    assert shm == {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def test_typed_template_fields_reach_the_pod():
    spec = make_spec({
        "labels": {"team": "rl", "cost-center": "42"}, "annotations": {"example.com/owner": "ana"},
        "imagePullSecrets": ["regcred"], "hostNetwork": True, "runtimeClassName": "rdma",
        "shmSize": "16Gi",
        "securityContext": {"runAsUser": 1000, "fsGroup": 2000, "addCapabilities": ["IPC_LOCK"]},
        "persistentVolumeClaims": [{"name": "ckpt", "claimName": "ckpt-pvc", "mountPath": "/ckpt",
                                    "subPath": "run1"}],
        "topologySpreadConstraints": [{"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 2,
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
    })
    pod = render.build_node_pod(spec, OWNER, rank=1, attempt=3)
    meta, pod_spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "rl" and meta["labels"]["cost-center"] == "42"
    assert meta["labels"]["distflow.io/node-rank"] == "1"
    assert meta["annotations"] == {"example.com/owner": "ana"}
    assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert (pod_spec["hostNetwork"], pod_spec["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert pod_spec["runtimeClassName"] == "rdma"
    assert pod_spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                                           "runAsUser": 1000, "fsGroup": 2000}
    container = pod_spec["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["ckpt"] == {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt-pvc", "readOnly": False}}
    assert {"name": "ckpt", "mountPath": "/ckpt", "readOnly": False, "subPath": "run1"} in container["volumeMounts"]
    assert pod_spec["topologySpreadConstraints"] == [{
        "maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"distflow.io/job-name": "grpo",
                                          "app.kubernetes.io/managed-by": "distflow-operator"}},
        "matchLabelKeys": ["distflow.io/attempt"]}]


def test_kueue_queue_makes_each_attempt_one_pod_group():
    spec = make_spec(num_nodes=4)
    owner = JobRef(name="grpo", namespace="team-a", uid="u", kueue_queue="team-a-queue")
    pods = [render.build_node_pod(spec, owner, rank, attempt=2) for rank in range(4)]
    for pod in pods:
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a-queue"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "grpo-a2"
        assert annotations == {"kueue.x-k8s.io/pod-group-total-count": "4",
                               "kueue.x-k8s.io/retriable-in-group": "false"}
    plain = render.build_node_pod(spec, OWNER, rank=0, attempt=2)
    assert not any(k.startswith("kueue.x-k8s.io/") for k in plain["metadata"]["labels"])
    assert "annotations" not in plain["metadata"]


def test_job_view_reads_the_kueue_queue_label():
    body = {"metadata": {"name": "grpo", "namespace": "team-a", "uid": "u",
                         "labels": {"kueue.x-k8s.io/queue-name": "lq"}},
            "spec": {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}}}}
    assert job_view(body).kueue_queue == "lq"
    body["metadata"]["labels"] = {}
    assert job_view(body).kueue_queue is None


@pytest.mark.parametrize(("template", "field"), [
    ({"labels": {"distflow.io/attempt": "9"}}, "spec.template.labels.distflow.io/attempt"),
    ({"labels": {"kueue.x-k8s.io/queue-name": "q"}}, "spec.template.labels.kueue.x-k8s.io/queue-name"),
    ({"annotations": {"kueue.x-k8s.io/pod-group-total-count": "1"}},
     "spec.template.annotations.kueue.x-k8s.io/pod-group-total-count"),
    ({"persistentVolumeClaims": [{"name": "dshm", "claimName": "c", "mountPath": "/x"}]},
     "spec.template.persistentVolumeClaims[0].name"),
])
def test_template_keys_the_operator_owns_are_rejected_by_field(template, field):
    spec = make_spec(template)
    problems = render.template_problems(spec)
    assert len(problems) == 1 and problems[0].startswith(field + ":"), problems
    with pytest.raises(DistflowConfigError):
        render.build_node_pod(spec, OWNER, rank=0, attempt=1)


@pytest.mark.parametrize(("template", "needle"), [
    ({"securityContext": {"runAsUser": 0}}, "runAsUser: 0 contradicts runAsNonRoot"),
    ({"shmSize": "lots"}, "template.shmSize"),
    ({"persistentVolumeClaims": [{"name": "c", "claimName": "c", "mountPath": "relative"}]}, "mountPath"),
    ({"topologySpreadConstraints": [{"topologyKey": "zone", "maxSkew": 0}]}, "maxSkew"),
])
def test_invalid_typed_fields_fail_spec_validation(template, needle):
    with pytest.raises(DistflowConfigError, match=needle):
        make_spec(template)


def test_root_is_allowed_only_when_asked_for():
    spec = make_spec({"securityContext": {"runAsNonRoot": False, "runAsUser": 0}})
    pod = render.build_node_pod(spec, OWNER, rank=0, attempt=1)
    assert pod["spec"]["securityContext"]["runAsUser"] == 0
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is False
