"""The CRD is generated from distflow.spec: checked-in file current, schema structural,
defaults/bounds/enums/docs carried over, CEL rules and printer columns present."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from distflow.spec import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, ClusterSpec, RolloutSpec
from distflow_operator import crdgen
from distflow_operator.render import OPERATOR_ENV_NAMES

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "rlposttrainjobs.distflow.io.yaml"


@pytest.fixture(scope="module")
def crd() -> dict:
    return crdgen.build_crd()


@pytest.fixture(scope="module")
def spec_props(crd) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def _walk(node, path=()):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, path + (name,))
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], path + ("*",))
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], path + ("*",))


def test_checked_in_crd_is_generated_from_the_current_spec_model():
    assert CRD_FILE.read_text() == crdgen.render_crd_yaml(), (
        "crds/rlposttrainjobs.distflow.io.yaml is stale; run: python -m distflow_operator.crdgen")


def test_check_mode_fails_on_a_stale_file_and_passes_after_writing(tmp_path, capsys):
    out = tmp_path / "crd.yaml"
    out.write_text("stale")
    assert crdgen.main(["--check", "--output", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
    assert crdgen.main(["--output", str(out)]) == 0
    assert crdgen.main(["--check", "--output", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["metadata"]["name"] == "rlposttrainjobs.distflow.io"


def test_by_default_it_writes_the_crd_and_the_charts_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert crdgen.main([]) == 0
    crd, chart = tmp_path / "crds" / CRD_FILE.name, tmp_path / "helm" / "distflow" / "crds" / CRD_FILE.name
    assert crd.read_text() == chart.read_text() == crdgen.render_crd_yaml()
    chart.write_text("stale")
    assert crdgen.main(["--check"]) == 1


def test_schema_is_structural(crd):
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        where = ".".join(path) or "<root>"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), where
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "nullable", "$defs"):
            assert banned not in node, f"{where}: {banned}"
        assert node.get("additionalProperties", {}) is not False, where
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, f"{where}: properties and additionalProperties"


def test_names_scope_and_status_subresource(crd):
    spec = crd["spec"]
    assert spec["group"] == "distflow.io" and spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "RLPostTrainJob", "listKind": "RLPostTrainJobList",
                             "plural": "rlposttrainjobs", "singular": "rlposttrainjob",
                             "shortNames": ["rljob"], "categories": ["distflow"]}
    version = spec["versions"][0]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {}, "scale": {"specReplicasPath": ".spec.cluster.numNodes",
                                "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector"}}


def test_printer_columns_show_phase_nodes_step_throughput_restarts_age(crd):
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert [c for c in columns if columns[c].get("priority", 0) == 0] == [
        "Phase", "Nodes", "Step", "Tokens/s", "Restarts", "Age"]
    assert columns["Nodes"]["jsonPath"] == ".status.nodes"
    assert columns["Step"] == {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"}
    assert columns["Tokens/s"]["jsonPath"] == ".status.progress.tokensPerSecond"
    assert columns["Age"]["type"] == "date"


def test_defaults_bounds_and_exclusive_bounds_come_from_the_model(spec_props):
    batch = spec_props["data"]["properties"]["trainBatchSize"]
    assert (batch["type"], batch["minimum"], batch["default"]) == ("integer", 1, 8)
    top_p = spec_props["rollout"]["properties"]["topP"]
    assert top_p == {"type": "number", "description": "Nucleus sampling threshold.", "minimum": 0.0,
                     "exclusiveMinimum": True, "maximum": 1.0, "default": 1.0}
    nodes = spec_props["cluster"]["properties"]["numNodes"]
    assert (nodes["minimum"], nodes["maximum"], nodes["default"]) == (1, 4096, 1)
    assert spec_props["model"]["properties"]["path"]["minLength"] == 1
    assert spec_props["workflow"]["properties"]["nodes"]["items"]["properties"]["id"]["pattern"] == \
        "^[a-z][a-z0-9_]*$"


def test_optional_fields_are_plain_types_without_null_or_default(spec_props):
    mini = spec_props["actor"]["properties"]["ppoMiniBatchSize"]
    assert mini == {"type": "integer", "minimum": 1,
                    "description": "Prompts per optimizer step (None: the whole train batch, one step)."}


def test_defaulted_sub_objects_get_empty_defaults_and_required_ones_do_not(spec_props):
    for name in ("rollout", "algorithm", "actor", "workflow", "cluster", "dataPlane", "checkpoint",
                 "trainer", "runPolicy", "scheduling", "template"):
        assert spec_props[name]["default"] == {}, name
    assert "default" not in spec_props["model"] and "default" not in spec_props["data"]
    assert "default" not in spec_props["data"]["properties"]["eval"]  # has the required `path`


def test_literals_and_named_choices_become_enums(spec_props):
    assert spec_props["rollout"]["properties"]["engine"]["enum"] == ["hf", "vllm"]
    algorithm = spec_props["algorithm"]["properties"]
    assert algorithm["advantageEstimator"]["enum"] == list(ADVANTAGE_ESTIMATORS)
    assert algorithm["klLossType"]["enum"] == list(KL_ESTIMATORS)
    assert spec_props["workflow"]["properties"]["name"]["enum"] == ["grpo", "ppo", "dapo"]


def test_free_form_maps_preserve_unknown_fields_and_string_maps_stay_typed(spec_props):
    template = spec_props["template"]["properties"]
    assert template["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert template["tolerations"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert template["nodeSelector"]["additionalProperties"] == {"type": "string"}
    options = spec_props["workflow"]["properties"]["nodes"]["items"]["properties"]["options"]
    assert options["x-kubernetes-preserve-unknown-fields"] is True


def test_descriptions_are_the_field_docstrings_on_one_line(spec_props):
    assert spec_props["cluster"]["properties"]["numNodes"]["description"] == \
        ClusterSpec.model_fields["num_nodes"].description
    expected = " ".join(RolloutSpec.model_fields["n"].description.split())
    assert spec_props["rollout"]["properties"]["n"]["description"] == expected
    assert spec_props["cluster"]["description"] == "Nodes x processes per node."


def test_fields_the_pods_compute_from_are_immutable_and_run_policy_is_not(spec_props):
    for name in set(crdgen.IMMUTABLE) - set(crdgen.RESIZABLE):
        rules = spec_props[name]["x-kubernetes-validations"]
        assert rules[0]["rule"] == "self == oldSelf" and f"spec.{name}" in rules[0]["message"]
    assert "x-kubernetes-validations" not in spec_props["runPolicy"]
    cluster_rule = spec_props["cluster"]["x-kubernetes-validations"][0]["rule"]
    assert "numNodes" not in cluster_rule
    assert "(has(self.maxNodes) ? has(oldSelf.maxNodes) && self.maxNodes == oldSelf.maxNodes" \
        " : !has(oldSelf.maxNodes))" in cluster_rule
    assert set(crdgen.IMMUTABLE) >= {"model", "cluster", "workflow", "algorithm"}


def test_env_rule_lists_every_variable_the_operator_sets(spec_props):
    env = spec_props["template"]["properties"]["env"]
    rule = env["x-kubernetes-validations"][0]["rule"]
    for name in OPERATOR_ENV_NAMES:
        assert f"'{name}'" in rule
    assert env["items"]["required"] == ["name"]
    assert env["items"]["x-kubernetes-preserve-unknown-fields"] is True


def test_spec_rules_cover_every_cross_field_size_check(crd):
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    paths = [r.get("fieldPath") for r in spec["x-kubernetes-validations"]]
    assert paths.count(".rollout.tensorParallelSize") == 2
    assert ".data.trainBatchSize" in paths and ".actor.ppoMiniBatchSize" in paths
    assert paths.count(".cluster.dataParallelShardDegree") == 2 and ".cluster.dataParallelReplicateDegree" in paths
    transition = [r for r in spec["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    assert len(transition) == 1 and "suspend" in transition[0]["rule"]


def test_name_rule_bounds_the_job_name_by_the_longest_pod_hostname(crd):
    rule = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"][0]
    assert f"size(self.metadata.name) <= {crdgen.MAX_NAME_LENGTH}" in rule["rule"]
    assert crdgen.MAX_NAME_LENGTH + len("-node-4095") == 63


def test_status_schema_has_phase_enum_and_condition_map(crd):
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["phase"]["enum"] == [
        "Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}
    for _, node in _walk(status):
        assert "default" not in node


def test_generator_refuses_what_a_structural_schema_cannot_express():
    class Mixed(BaseModel):
        value: int | str

    with pytest.raises(ValueError, match="anyOf"):
        crdgen.model_schema(Mixed, with_defaults=True)


def test_keys_go_yaml_reads_as_booleans_are_quoted():
    class GoLikeLoader(yaml.SafeLoader):
        """YAML 1.1 as Go's parser reads it: y/n are booleans too."""

    GoLikeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"),
                                       list("yYnN"))
    crd = yaml.load(crdgen.render_crd_yaml(), Loader=GoLikeLoader)
    rollout = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rollout"]
    assert "n" in rollout["properties"] and False not in rollout["properties"]
    example = yaml.load((REPO / "examples" / "rljob.yaml").read_text(), Loader=GoLikeLoader)
    assert example["spec"]["rollout"] == {"n": 2}
