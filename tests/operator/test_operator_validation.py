"""Bad RLPostTrainJobs: the API server rejects them naming the field (schema, enums, CEL),
or the operator marks them Failed with a reason; the operator never crashes."""

from __future__ import annotations

import copy
import json
import random

import pytest

from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path, wait_for,
)

pytestmark = pytest.mark.operator

DELETE = object()


def mutate(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return doc


ROLE_NODE = {"id": "judge", "role": "judge", "kind": "compute"}

# (path to set, value, field the API server's message must name)
REJECTED = [
    # wrong types
    ("spec.cluster.numNodes", "two", "spec.cluster.numNodes"),
    ("spec.cluster.procsPerNode", 1.5, "spec.cluster.procsPerNode"),
    ("spec.data.trainBatchSize", "8", "spec.data.trainBatchSize"),
    ("spec.rollout.temperature", "hot", "spec.rollout.temperature"),
    ("spec.rollout.n", True, "spec.rollout.n"),
    ("spec.data.shuffle", "yes", "spec.data.shuffle"),
    ("spec.model", "tiny", "spec.model"),
    ("spec.data.train", ["arithmetic"], "spec.data.train"),
    ("spec.template.env", {"A": "1"}, "spec.template.env"),
    ("spec.template.nodeSelector", {"pool": 3}, "spec.template.nodeSelector.pool"),
    ("spec.workflow.nodes", "grpo", "spec.workflow.nodes"),
    ("spec.runPolicy.suspend", "no", "spec.runPolicy.suspend"),
    ("spec.actor.lr", "fast", "spec.actor.lr"),
    ("spec.trainer.totalSteps", [10], "spec.trainer.totalSteps"),
    ("spec.algorithm.useKlLoss", 1, "spec.algorithm.useKlLoss"),
    # out of range
    ("spec.cluster.numNodes", 0, "spec.cluster.numNodes"),
    ("spec.cluster.numNodes", 5000, "spec.cluster.numNodes"),
    ("spec.cluster.procsPerNode", 0, "spec.cluster.procsPerNode"),
    ("spec.cluster.procsPerNode", 65, "spec.cluster.procsPerNode"),
    ("spec.cluster.acceleratorsPerNode", -1, "spec.cluster.acceleratorsPerNode"),
    ("spec.rollout.topP", 0, "spec.rollout.topP"),
    ("spec.rollout.topP", 1.5, "spec.rollout.topP"),
    ("spec.rollout.temperature", -0.1, "spec.rollout.temperature"),
    ("spec.algorithm.clipRatioLow", 1.0, "spec.algorithm.clipRatioLow"),
    ("spec.algorithm.gamma", 2, "spec.algorithm.gamma"),
    ("spec.algorithm.clipRatioC", 1.0, "spec.algorithm.clipRatioC"),
    ("spec.runPolicy.maxRestarts", -1, "spec.runPolicy.maxRestarts"),
    ("spec.runPolicy.maxRestarts", 101, "spec.runPolicy.maxRestarts"),
    ("spec.runPolicy.backoffSeconds", 4000, "spec.runPolicy.backoffSeconds"),
    ("spec.runPolicy.activeDeadlineSeconds", 0, "spec.runPolicy.activeDeadlineSeconds"),
    ("spec.actor.lr", 0, "spec.actor.lr"),
    ("spec.trainer.metricsPort", 70000, "spec.trainer.metricsPort"),
    ("spec.data.maxResponseLength", 0, "spec.data.maxResponseLength"),
    ("spec.checkpoint.keepLast", 0, "spec.checkpoint.keepLast"),
    # unknown names
    ("spec.algorithm.advantageEstimator", "ppo2", "spec.algorithm.advantageEstimator"),
    ("spec.algorithm.policyLoss", "dpo", "spec.algorithm.policyLoss"),
    ("spec.algorithm.klLossType", "k4", "spec.algorithm.klLossType"),
    ("spec.algorithm.lossAggMode", "sum", "spec.algorithm.lossAggMode"),
    ("spec.rollout.engine", "sglang", "spec.rollout.engine"),
    ("spec.model.dtype", "int8", "spec.model.dtype"),
    ("spec.cluster.device", "tpu", "spec.cluster.device"),
    ("spec.workflow.name", "sft", "spec.workflow.name"),
    ("spec.workflow.nodes", [ROLE_NODE], "spec.workflow.nodes[0].role"),
    ("spec.workflow.nodes", [{"id": "a", "role": "reward", "kind": "eval"}], "spec.workflow.nodes[0].kind"),
    ("spec.scheduling.batchScheduler", "kueue", "spec.scheduling.batchScheduler"),
    ("spec.template.imagePullPolicy", "Sometimes", "spec.template.imagePullPolicy"),
    ("spec.checkpoint.resume", "maybe", "spec.checkpoint.resume"),
    # missing or empty
    ("spec.model", DELETE, "spec.model"),
    ("spec.data", DELETE, "spec.data"),
    ("spec.data.train", DELETE, "spec.data.train"),
    ("spec.data.train.path", DELETE, "spec.data.train.path"),
    ("spec.model.path", "", "spec.model.path"),
    ("spec.workflow.nodes", [{"role": "reward", "kind": "compute"}], "spec.workflow.nodes[0].id"),
    ("spec.workflow.nodes", [{"id": "Bad-ID", "role": "reward", "kind": "compute"}], "spec.workflow.nodes[0].id"),
    # unknown fields (kubectl's strict field validation)
    ("spec.modle", {"path": "x"}, "spec.modle"),
    ("spec.cluster.gpus", 8, "spec.cluster.gpus"),
    ("spec.rollout.beam", 4, "spec.rollout.beam"),
    # env the operator owns
    ("spec.template.env", [{"name": "MASTER_ADDR", "value": "x"}], "spec.template.env"),
    ("spec.template.env", [{"name": "PET_NODE_RANK", "value": "0"}], "spec.template.env"),
    ("spec.template.env", [{"name": "WORLD_SIZE", "value": "9"}], "spec.template.env"),
    ("spec.template.env", [{"name": "DISTFLOW_CONFIG", "value": "/x"}], "spec.template.env"),
    ("spec.template.env", [{"value": "no name"}], "spec.template.env[0].name"),
    # names that cannot name the pods
    ("metadata.name", "1-starts-with-a-digit", "metadata.name"),
    ("metadata.name", "x" * 60, "metadata.name"),
]

# Cross-field size rules: the API server (CEL) and distflow.spec reject them naming the same field.
CROSS_FIELD = [
    {"rollout": {"tensorParallelSize": 3}},
    {"data": {"trainBatchSize": 3}},
    {"data": {"trainBatchSize": 4}, "actor": {"ppoMiniBatchSize": 3}},
    {"rollout": {"tensorParallelSize": 2}},
    {"cluster": {"numNodes": 2, "procsPerNode": 2, "dataParallelReplicateDegree": 3}},
    {"cluster": {"numNodes": 2, "procsPerNode": 2, "dataParallelShardDegree": 3}},
    {"cluster": {"numNodes": 2, "procsPerNode": 2, "dataParallelReplicateDegree": 1, "dataParallelShardDegree": 2}},
]

# Pass the schema, fail in the operator's checks: Failed with reason InvalidSpec.
OPERATOR_REJECTED = [
    ("spec.template.resources", {"limits": {"nvidia.com/gpu": "8"}}, "spec.template.resources.limits.nvidia.com/gpu"),
    ("spec.template.volumes", [{"name": "dshm", "emptyDir": {}}], "spec.template.volumes[0].name"),
    ("spec.template.volumeMounts", [{"name": "distflow-spec", "mountPath": "/x"}],
     "spec.template.volumeMounts[0].name"),
]


def base_job(name: str) -> dict:
    # Suspended: valid jobs created here hold no fake GPUs; invalid ones fail before suspend applies.
    return example_job(name, runPolicy={"suspend": True})


def test_generated_bad_specs_are_rejected_naming_the_field_or_failed_with_a_reason(api, operator):
    assert len(REJECTED) + len(CROSS_FIELD) + len(OPERATOR_REJECTED) >= 50
    unnamed = []
    for i, (path, value, field) in enumerate(REJECTED):
        doc = mutate(base_job(f"bad-{i}"), path, value)
        status, body = api.create_job(doc)
        if status not in (400, 422) or field not in body.get("message", ""):
            unnamed.append((path, value, status, body.get("message")))
    assert not unnamed, json.dumps(unnamed, indent=1, default=str)

    for i, update in enumerate(CROSS_FIELD):
        doc = base_job(f"cross-{i}")
        for section, fields in update.items():
            doc["spec"][section] = {**doc["spec"].get(section, {}), **fields}
        with pytest.raises(DistflowConfigError) as err:
            parse_spec(doc["spec"])
        status, body = api.create_job(doc)
        assert status == 422, body
        for problem in err.value.problems:  # same field path (CEL messages carry no numbers)
            assert problem.split(": ")[0] in body["message"], (problem, body["message"])

    for i, (path, value, _) in enumerate(OPERATOR_REJECTED):
        status, body = api.create_job(mutate(base_job(f"late-{i}"), path, value))
        assert status == 201, body
    for i, (_, _, field) in enumerate(OPERATOR_REJECTED):
        failed = api.wait_phase(f"late-{i}", "Failed")
        assert failed["reason"] == "InvalidSpec" and field in failed["message"]
        assert not api.pods(f"late-{i}")


def test_kubectl_apply_names_the_field(control_plane, k8s_namespace, crd):
    doc = mutate(base_job("typo"), "spec.cluster.numNodes", -3)
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=json.dumps(doc))
    assert out.returncode != 0
    assert "spec.cluster.numNodes" in out.stderr and "greater than or equal to 1" in out.stderr
    doc = mutate(base_job("typo"), "spec.algorithm.advantageEstimator", "grp0")
    out = control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=json.dumps(doc))
    assert "spec.algorithm.advantageEstimator" in out.stderr and '"grpo"' in out.stderr


def test_fields_the_pods_compute_from_cannot_change_while_the_job_exists(api, operator):
    assert api.create_job(base_job("fixed"))[0] == 201
    for patch, field in (({"model": {"path": "tiny:qwen"}}, "spec.model"),
                         ({"cluster": {"procsPerNode": 2}}, "spec.cluster"),
                         ({"cluster": {"maxNodes": 8}}, "spec.cluster"),
                         ({"algorithm": {"advantageEstimator": "rloo"}}, "spec.algorithm")):
        status, body = api.patch_job("fixed", {"spec": patch})
        assert status == 422 and f"{field} cannot change while the job exists" in body["message"]
    assert api.patch_job("fixed", {"spec": {"runPolicy": {"maxRestarts": 7}}})[0] == 200


FUZZ_FIELDS = ["spec.cluster.numNodes", "spec.cluster.procsPerNode", "spec.data.trainBatchSize",
               "spec.rollout.n", "spec.rollout.tensorParallelSize", "spec.actor.ppoMiniBatchSize",
               "spec.rollout.topP", "spec.algorithm.gamma", "spec.runPolicy.maxRestarts",
               "spec.trainer.totalSteps", "spec.rollout.engine", "spec.model.path"]
FUZZ_VALUES = [-1, 0, 1, 2, 3, 7, 0.5, 1.5, "x", None, True, [], {}, "vllm", "hf", 10**9]


def test_random_mutations_never_crash_the_operator_and_agree_with_the_model(api, operator):
    rng = random.Random(20250601)
    accepted = {}
    for i in range(60):
        doc = base_job(f"fuzz-{i}")
        for _ in range(rng.randint(1, 3)):
            doc = mutate(doc, rng.choice(FUZZ_FIELDS), rng.choice(FUZZ_VALUES))
        status, body = api.create_job(doc)
        if status == 201:
            accepted[f"fuzz-{i}"] = body["spec"]
        else:
            assert status in (400, 422) and "spec." in body["message"], body
    assert accepted, "the fuzz should also produce valid jobs"
    for name, spec in accepted.items():
        status = wait_for(lambda name=name: (s := api.status(name)).get("phase") in ("Suspended", "Failed") and s,
                          20, what=f"{name} handled")
        try:
            parse_spec(spec)
            assert status["phase"] == "Suspended", (name, status)
        except DistflowConfigError:
            assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec"), (name, status)
    # Still healthy: a good job runs.
    api.create_job(example_job("after-fuzz"))
    api.wait_phase("after-fuzz", "Running")
