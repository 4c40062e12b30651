"""Manifest rendering: the objects a job's spec turns into, value by value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from distflow.errors import DistflowConfigError
from distflow.spec import SPEC_SCHEMA_VERSION, load_job_spec, parse_spec, spec_from_manifest
from distflow_operator import render
from distflow_operator.render import JobRef

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"
OWNER = JobRef(name="grpo", namespace="team-a", uid="0b6c-uid")


def make_spec(**sections):
    base = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8},
            "cluster": {"numNodes": 4, "procsPerNode": 2, "acceleratorsPerNode": 2}}
    base.update(sections)
    return parse_spec(base)


def env_of(pod) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_example_job_is_a_valid_two_node_spec():
    spec = load_job_spec(EXAMPLE)
    assert spec.cluster.num_nodes == 2 and spec.model.path == "tiny"


def test_node_env_is_torchrun_style_for_its_rank():
    pod = render.build_node_pod(make_spec(), OWNER, rank=3, attempt=2)
    env = env_of(pod)
    assert {k: env[k] for k in render.OPERATOR_ENV_NAMES} == {
        "PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "grpo-node-0.grpo.team-a.svc", "MASTER_PORT": "29500",
        "WORLD_SIZE": "8",  # 4 nodes x 2 processes
        "DISTFLOW_JOB_NAME": "grpo", "DISTFLOW_ATTEMPT": "2",
        "DISTFLOW_CONFIG": "/etc/distflow/spec.yaml", "DISTFLOW_METRICS_PORT": "9400",
        "DISTFLOW_TERMINATION_LOG": "/dev/termination-log",
    }


def test_node_pod_identity_labels_and_owner():
    pod = render.build_node_pod(make_spec(), OWNER, rank=1, attempt=1)
    meta, spec = pod["metadata"], pod["spec"]
    assert (meta["name"], meta["namespace"]) == ("grpo-node-1", "team-a")
    assert (spec["hostname"], spec["subdomain"]) == ("grpo-node-1", "grpo")
    assert meta["labels"] == {
        "app.kubernetes.io/name": "distflow", "app.kubernetes.io/instance": "grpo",
        "app.kubernetes.io/component": "node", "app.kubernetes.io/part-of": "distflow",
        "app.kubernetes.io/managed-by": "distflow-operator",
        "distflow.io/job-name": "grpo", "distflow.io/node-rank": "1", "distflow.io/attempt": "1"}
    assert meta["ownerReferences"] == [{"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob",
                                        "name": "grpo", "uid": "0b6c-uid", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert spec["restartPolicy"] == "Never"
    container = spec["containers"][0]
    assert container["command"] == ["distflow", "node", "--config", "/etc/distflow/spec.yaml"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert {"name": "distflow-spec", "mountPath": "/etc/distflow", "readOnly": True} in container["volumeMounts"]
    assert {"name": "distflow-spec", "configMap": {"name": "grpo-config"}} in spec["volumes"]


def test_accelerators_become_gpu_requests_and_limits_next_to_user_resources():
    spec = make_spec(template={"resources": {"requests": {"cpu": "4"}, "limits": {"memory": "16Gi"}}})
    resources = render.build_node_pod(spec, OWNER, 0, 1)["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "4", "nvidia.com/gpu": "2"},
                         "limits": {"memory": "16Gi", "nvidia.com/gpu": "2"}}


def test_cpu_cluster_requests_no_gpu():
    spec = make_spec(cluster={"numNodes": 2, "acceleratorsPerNode": 0})
    assert render.build_node_pod(spec, OWNER, 0, 1)["spec"]["containers"][0]["resources"] == {}


def test_user_overrides_reach_the_pod_and_env_follows_the_operator_env():
    spec = make_spec(template={
        "image": "registry.local/worker:1", "env": [{"name": "HF_HOME", "value": "/cache"}],
        "nodeSelector": {"pool": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"x": 1}}, "volumes": [{"name": "ckpt", "emptyDir": {}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}], "serviceAccountName": "trainer"})
    pod = render.build_node_pod(spec, OWNER, 0, 1)
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry.local/worker:1"
    assert container["env"][-1] == {"name": "HF_HOME", "value": "/cache"}
    assert [e["name"] for e in container["env"][:len(render.OPERATOR_ENV_NAMES)]] == list(render.OPERATOR_ENV_NAMES)
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["spec"]["affinity"] == {"nodeAffinity": {"x": 1}}
    assert pod["spec"]["volumes"][-1] == {"name": "ckpt", "emptyDir": {}}
    assert container["volumeMounts"][-1] == {"name": "ckpt", "mountPath": "/ckpt"}
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert "automountServiceAccountToken" not in pod["spec"]


def test_pods_get_no_api_token_unless_a_service_account_is_asked_for():
    assert render.build_node_pod(make_spec(), OWNER, 0, 1)["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", ["MASTER_ADDR", "PET_NODE_RANK", "WORLD_SIZE", "DISTFLOW_CONFIG"])
def test_env_that_collides_with_rank_variables_is_rejected_naming_the_field(name):
    spec = make_spec(template={"env": [{"name": "OK", "value": "1"}, {"name": name, "value": "x"}]})
    assert render.template_problems(spec) == [
        f"spec.template.env[1].name: {name} is set by the operator (rank variables: "
        f"{', '.join(render.OPERATOR_ENV_NAMES)}); remove it"]
    with pytest.raises(DistflowConfigError, match=r"spec\.template\.env\[1\]\.name"):
        render.build_node_pod(spec, OWNER, 0, 1)


def test_reserved_volume_names_and_nameless_env_are_rejected():
    spec = make_spec(template={"env": [{"value": "1"}], "volumes": [{"name": "dshm", "emptyDir": {}}]})
    assert render.template_problems(spec) == [
        "spec.template.env[0].name: each env entry needs a name; add one",
        "spec.template.volumes[0].name: dshm is used by the operator; pick another name"]


@pytest.mark.parametrize("field", ["template", "rolloutPool"])
def test_a_gpu_count_in_pod_resources_is_refused_by_the_spec_itself(field):
    """The spec's checks, not the operator's rendering: `distflow validate` says it before any apply."""
    resources = {"limits": {"nvidia.com/gpu": "8"}}
    sections = ({"template": {"resources": resources}} if field == "template" else
                {"cluster": {"numNodes": 3}, "async": {"enable": True, "rolloutPool": {"resources": resources}}})
    path = "spec.template.resources" if field == "template" else "spec.async.rolloutPool.resources"
    with pytest.raises(DistflowConfigError) as err:
        make_spec(**sections)
    assert err.value.problems == [f"{path}.limits.nvidia.com/gpu: set cluster.acceleratorsPerNode instead "
                                  "(the operator adds nvidia.com/gpu to every node pod from it); remove it here"]


def test_config_map_holds_the_spec_without_its_defaults_and_parses_back_equal():
    spec = make_spec(rollout={"n": 3})
    cm = render.build_config_map(spec, OWNER)
    assert cm["metadata"]["name"] == "grpo-config"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "0b6c-uid"
    loaded = yaml.safe_load(cm["data"]["spec.yaml"])
    # Defaults left to the worker image: an older image reads what it knows (the version-skew contract).
    assert loaded["spec"]["rollout"] == {"n": 3} and "actor" not in loaded["spec"]
    assert (loaded["kind"], loaded["schemaVersion"]) == ("RLPostTrainJob", SPEC_SCHEMA_VERSION)
    assert spec_from_manifest(loaded) == spec


def test_resize_requests_render_the_three_kinds_of_request_exactly():
    assert render.resize_request_value(3) == '{"numNodes": 3}'
    assert render.resize_request_value(3, 2) == '{"numNodes": 3, "rolloutNodes": 2}'
    assert render.resize_request_value(3, in_place=True) == '{"numNodes": 3, "inPlace": true}'
    with pytest.raises(AssertionError):
        render.resize_request_value(3, 2, in_place=True)


def test_a_joining_node_of_a_synchronous_gang_gets_the_new_size_and_the_join_flag():
    spec = make_spec()  # the spec at the new size: 4 nodes
    env = env_of(render.build_node_pod(spec, OWNER, rank=3, attempt=1, joining=True))
    assert (env["DISTFLOW_JOIN"], env["PET_NNODES"], env["PET_NODE_RANK"], env["WORLD_SIZE"], env["DISTFLOW_ATTEMPT"]) \
        == ("1", "4", "3", "8", "1")
    data = render.build_config_map(spec, OWNER, render.resize_request_value(4, in_place=True))["data"]
    assert data["resize"] == '{"numNodes": 4, "inPlace": true}'
    assert yaml.safe_load(data["spec.yaml"])["spec"]["cluster"]["numNodes"] == 4


def test_headless_service_publishes_not_ready_addresses():
    svc = render.build_headless_service(make_spec(trainer={"metricsPort": 9555}), OWNER)
    assert svc["metadata"]["name"] == "grpo"
    assert svc["spec"] == {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": {"distflow.io/job-name": "grpo", "app.kubernetes.io/managed-by": "distflow-operator"},
        "ports": [{"name": "rendezvous", "port": 29500, "targetPort": 29500},
                  {"name": "metrics", "port": 9555, "targetPort": 9555}]}


def test_metrics_port_follows_trainer_metrics_port_else_9400():
    assert render.metrics_port(make_spec()) == 9400
    pod = render.build_node_pod(make_spec(trainer={"metricsPort": 9555}), OWNER, 0, 1)
    assert pod["spec"]["containers"][0]["ports"][0]["containerPort"] == 9555
    assert env_of(pod)["DISTFLOW_METRICS_PORT"] == "9555"


def test_no_pod_group_without_a_batch_scheduler():
    spec = make_spec()
    assert render.build_pod_groups(spec, OWNER) == []
    pod = render.build_node_pod(spec, OWNER, 0, 1)
    assert "schedulerName" not in pod["spec"] and "annotations" not in pod["metadata"]


def test_volcano_pod_group_gangs_all_nodes_in_a_queue():
    spec = make_spec(scheduling={"batchScheduler": "volcano", "queue": "research", "priorityClassName": "high"})
    [group] = render.build_pod_groups(spec, OWNER)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["metadata"]["name"] == "grpo"
    assert group["spec"] == {"minMember": 4, "minResources": {"nvidia.com/gpu": "8"}, "queue": "research",
                             "priorityClassName": "high"}
    pod = render.build_node_pod(spec, OWNER, 2, 1)
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": "grpo"}


def test_scheduler_plugins_pod_group_labels_pods_and_honours_scheduler_name():
    spec = make_spec(scheduling={"batchScheduler": "scheduler-plugins", "schedulerName": "my-sched"})
    [group] = render.build_pod_groups(spec, OWNER)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["spec"]["minMember"] == 4
    pod = render.build_node_pod(spec, OWNER, 0, 1)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "grpo"
    assert pod["spec"]["schedulerName"] == "my-sched"


def test_rendering_is_deterministic_and_never_aliases_the_spec():
    spec = make_spec(template={"env": [{"name": "A", "value": "1"}], "affinity": {"a": {"b": 1}}})
    first = render.build_node_pod(spec, OWNER, 0, 1)
    assert first == render.build_node_pod(spec, OWNER, 0, 1)
    first["spec"]["containers"][0]["env"][-1]["value"] = "changed"
    first["spec"]["affinity"]["a"]["b"] = 2
    assert spec.template.env == [{"name": "A", "value": "1"}]
    assert spec.template.affinity == {"a": {"b": 1}}


def test_pod_group_patch_follows_scheduling_edits_and_leaves_scheduler_fields_alone():
    from distflow_operator.kube import pod_group_patch

    current = {"minMember": 2, "queue": "old", "priorityClassName": "high", "minTaskMember": {"x": 1}}
    assert pod_group_patch(current, {"minMember": 2, "queue": "new"}) == {"queue": "new", "priorityClassName": None}
    assert pod_group_patch({"minMember": 2}, {"minMember": 2}) == {}
