"""The job spec: validation messages name the field and the fix; names match the runtime."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distflow.errors import DistflowConfigError
from distflow.spec import dump_spec, load_job_spec, parse_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}}}


def _problems(doc) -> list[str]:
    with pytest.raises(DistflowConfigError) as info:
        parse_spec(doc)
    return info.value.problems


def test_minimal_spec_gets_defaults():
    spec = parse_spec(MINIMAL)
    assert spec.world_size == 1
    assert spec.algorithm.advantage_estimator == "grpo"
    assert spec.data_plane.mode == "distributed"
    assert dump_spec(spec)["data"]["trainBatchSize"] == 8


def test_camel_and_snake_case_are_both_accepted():
    a = parse_spec({**MINIMAL, "cluster": {"numNodes": 2}})
    b = parse_spec({**MINIMAL, "cluster": {"num_nodes": 2}})
    assert a == b and a.cluster.num_nodes == 2


@pytest.mark.parametrize("doc, path, fix", [
    ({"model": {"path": "tiny"}}, "spec.data", "required"),
    ({**MINIMAL, "modle": {}}, "spec.modle", "remove it"),
    ({**MINIMAL, "rollout": {"n": 0}}, "spec.rollout.n", "greater than or equal to 1 (got 0); use a value >= 1"),
    ({**MINIMAL, "rollout": {"topP": 2.0}}, "spec.rollout.topP", "(got 2.0); use a value <= 1"),
    ({**MINIMAL, "trainer": {"totalSteps": 2.5}}, "spec.trainer.totalSteps", "(got 2.5); use a whole number"),
    ({**MINIMAL, "async": {"maxStaleness": -1}}, "spec.async.maxStaleness", "(got -1); use a value >= 0"),
    # YAML's true/false are not numbers (pydantic would read true as 1)
    ({**MINIMAL, "trainer": {"totalSteps": True}}, "spec.trainer.totalSteps", "(got True); use a whole number"),
    ({**MINIMAL, "actor": {"lr": False}}, "spec.actor.lr", "(got False); use a number"),
    ({**MINIMAL, "trainer": {"metricsPort": True}}, "spec.trainer.metricsPort", "(got True); use a whole number"),
    # a section given as a value: name its fields
    ({**MINIMAL, "async": True}, "spec.async",
     "expected a section, a mapping of its fields (got True); use e.g. async: {enable: ..."),
    # YAML 1.1 reads yes/no/on/off as true/false: a choice of words says to quote it
    # ... and a word that is no choice, quoted or not, gets the choices (off: none)
    ({**MINIMAL, "async": {"offPolicyCorrection": True}}, "spec.async.offPolicyCorrection",
     "(got True); YAML reads yes, no, on and off as true and false, and none of them is a choice here; "
     "use one of 'tis', 'none'"),
    ({**MINIMAL, "async": {"offPolicyCorrection": False}}, "spec.async.offPolicyCorrection",
     "(got False); YAML reads no and off as false; to turn it off, use 'none'"),
    # a word not among the choices: the closest choice, else the choices
    ({**MINIMAL, "async": {"offPolicyCorrection": "TIS"}}, "spec.async.offPolicyCorrection",
     "(got 'TIS'); did you mean 'tis'?"),
    ({**MINIMAL, "async": {"offPolicyCorrection": "foo"}}, "spec.async.offPolicyCorrection",
     "(got 'foo'); use one of 'tis', 'none'"),
    ({**MINIMAL, "async": {"offPolicyCorrection": None}}, "spec.async.offPolicyCorrection",
     "(got None); YAML reads null, ~ and an empty value as no value; to turn it off, use 'none'"),
    ({**MINIMAL, "async": {"tisCap": 0.5}}, "spec.async.tisCap", "(got 0.5); use a value >= 1"),
    ({**MINIMAL, "async": {"tisCap": float("inf")}}, "spec.async.tisCap", "use a finite number"),
    # YAML 1.1 reads 1e3 as text: say what to write
    ({**MINIMAL, "trainer": {"totalSteps": "1e3"}}, "spec.trainer.totalSteps",
     "(got '1e3'); use a whole number: 1000 (YAML reads 1e3 as text)"),
    ({**MINIMAL, "rollout": {"temperature": "hot"}}, "spec.rollout.temperature", "got 'hot'"),
    ({**MINIMAL, "algorithm": {"advantageEstimator": "ppo2"}}, "spec.algorithm.advantageEstimator",
     "unknown 'ppo2'; choose one of grpo"),
    # a choice checked by the model (not a Literal): the closest choice whatever its case, and all
    ({**MINIMAL, "algorithm": {"advantageEstimator": "GRPO"}}, "spec.algorithm.advantageEstimator",
     "unknown 'GRPO'; did you mean 'grpo'? choose one of grpo, drgrpo, rloo"),
    ({**MINIMAL, "algorithm": {"klLossType": "lowvar_kl"}}, "spec.algorithm.klLossType",
     "did you mean 'low_var_kl'?"),
    ({**MINIMAL, "algorithm": {"lossAggMode": "mean"}}, "spec.algorithm.lossAggMode", "token-mean"),
    ({**MINIMAL, "algorithm": {"advantageEstimator": "gae"}}, "spec.algorithm.advantageEstimator",
     "gae computes advantages from a critic's values, and the grpo workflow has no critic; use workflow.name: ppo"),
    # seeds numpy and torch take: 0 .. 2**32 - 1 (numpy refuses a negative one, torch one of 2**64)
    ({**MINIMAL, "data": {"train": {"path": "arithmetic", "seed": -5}}}, "spec.data.train.seed",
     "(got -5); use a value >= 0"),
    ({**MINIMAL, "data": {"train": {"path": "arithmetic"}, "seed": -1}}, "spec.data.seed", "use a value >= 0"),
    ({**MINIMAL, "trainer": {"seed": 2**64}}, "spec.trainer.seed", "use a value <= 4294967295"),
    # pod resources and tolerations as the API server would take them in the operator's pods
    ({**MINIMAL, "template": {"resources": {"cpu": "2"}}}, "spec.template.resources.cpu",
     "a container's resources have requests and limits; put it under requests"),
    ({**MINIMAL, "template": {"resources": {"requests": {"cpu": "two"}}}}, "spec.template.resources.requests.cpu",
     "'two' is not a Kubernetes quantity"),
    ({**MINIMAL, "template": {"resources": {"limits": {"memory": "4GB"}}}}, "spec.template.resources.limits.memory",
     "'4GB' is not a Kubernetes quantity"),
    ({**MINIMAL, "template": {"tolerations": [{"key": "x", "operator": "Bogus"}]}},
     "spec.template.tolerations[0].operator", "'Bogus'; use Exists or Equal"),
    ({**MINIMAL, "template": {"tolerations": [{"key": "x", "operator": "exists"}]}},
     "spec.template.tolerations[0].operator", "'exists'; did you mean 'Exists'? use Exists or Equal"),
    ({**MINIMAL, "template": {"tolerations": [{"value": "x"}]}}, "spec.template.tolerations[0].key",
     "a toleration without a key matches every taint only with operator: Exists"),
    ({**MINIMAL, "template": {"tolerations": [{"key": "x", "effect": "NoSchedule", "tolerationSeconds": 60}]}},
     "spec.template.tolerations[0].tolerationSeconds", "only a NoExecute toleration has one"),
    ({**MINIMAL, "template": {"resources": {"request": {"cpu": "2"}}}}, "spec.template.resources.request",
     "did you mean 'requests'?"),
    ({**MINIMAL, "template": {"resources": {"requests": {"cpus": "2"}}}}, "spec.template.resources.requests.cpus",
     "did you mean 'cpu'? a resource without a domain is one of cpu, memory, ephemeral-storage"),
    ({**MINIMAL, "template": {"resources": {"requests": {"memory": "-1"}}}},
     "spec.template.resources.requests.memory", "'-1' is negative; use 0 or more"),
    ({**MINIMAL, "template": {"resources": {"requests": {"cpu": "2\n"}}}}, "spec.template.resources.requests.cpu",
     "is not a Kubernetes quantity"),
    ({**MINIMAL, "template": {"resources": {"limits": {"example.com/fpga": 0.5}}}},
     "spec.template.resources.limits.example.com/fpga", "counted in whole units"),
    ({**MINIMAL, "template": {"tolerations": [{"key": "x", "operator": "Exists", "effect": "NoSchedul"}]}},
     "spec.template.tolerations[0].effect", "did you mean 'NoSchedule'?"),
    ({**MINIMAL, "cluster": {"numNodes": 2}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
      "async": {"enable": True, "rolloutPool": {"numNodes": 1, "resources": {"memory": "4Gi"}}}},
     "spec.async.rolloutPool.resources.memory", "put it under requests"),
    ({**MINIMAL, "cluster": {"numNodes": 2}, "data": {"train": {"path": "x"}, "trainBatchSize": 3}},
     "spec.data.trainBatchSize", "multiple of 2"),
    ({**MINIMAL, "actor": {"ppoMiniBatchSize": 3}}, "spec.actor.ppoMiniBatchSize", "divisor of 8"),
    ({**MINIMAL, "rollout": {"tensorParallelSize": 2}, "cluster": {"numNodes": 2}},
     "spec.rollout.tensorParallelSize", "set it to 1"),
    ({**MINIMAL, "dataPlane": {"mode": "driver"}}, "spec.dataPlane.mode", "centralized"),
    ({**MINIMAL, "rollout": {"val": {"n": 4}}}, "spec.rollout.val.n", "set rollout.val.temperature > 0"),
    ({**MINIMAL, "model": {"path": "tiny:llama"}}, "spec.model.path", "tiny:<auto|byte|smollm2>"),
    ({**MINIMAL, "data": {"train": {"path": "x"}, "rewardFn": "nosuch"}}, "spec.data.rewardFn", "module:function"),
    ({**MINIMAL, "data": {"train": {"path": "arithmetic", "minOperand": 50, "maxOperand": 20}}},
     "spec.data.train.minOperand", "swap them"),
    ({**MINIMAL, "data": {"train": {"path": "arithmetic"}, "eval": {"path": "arithmetic:foo"}}},
     "spec.data.eval.path", "unknown arithmetic split"),
    ({**MINIMAL, "data": {"train": {"path": "arithmetic"}, "eval": {"path": "arithmetic:train"}}},
     "spec.data.eval.path", "hold out with arithmetic:eval"),
])
def test_bad_spec_names_field_and_fix(doc, path, fix):
    problems = _problems(doc)
    assert any(p.startswith(path + ":") and fix in p for p in problems), problems


@pytest.mark.parametrize("doc, problem", [
    ({**MINIMAL, "data": {"train": {"path": "x"}, "trainBatchSzie": 4}},
     "spec.data.trainBatchSzie: unknown field; did you mean trainBatchSize? (or remove it; fields are camelCase)"),
    ({**MINIMAL, "actor": {"learningRate": 1e-6}},
     "spec.actor.learningRate: unknown field; remove it or check its spelling (fields are camelCase)"),
    ({**MINIMAL, "async": {"rolloutPool": {"numNode": 1}}},
     "spec.async.rolloutPool.numNode: unknown field; did you mean numNodes? (or remove it; fields are camelCase)"),
    ({**MINIMAL, "data": {"train": {"path": "x"}, "train_batch_size": 4, "trainBatchSize": 4}},
     "spec.data.train_batch_size: given twice, as train_batch_size and trainBatchSize; keep one"),
    ({**MINIMAL, "modle": {}}, "spec.modle: unknown field; did you mean model? (or remove it; fields are camelCase)"),
    ({**MINIMAL, "rollout": {"maxResponseLength": 12}},
     "spec.rollout.maxResponseLength: not a field of this section; it is spec.data.maxResponseLength"),
])
def test_an_unknown_field_gets_the_known_one_it_is_closest_to(doc, problem):
    assert problem in _problems(doc)


def test_every_problem_is_reported_at_once():
    problems = _problems({**MINIMAL, "rollout": {"n": 0, "topP": 2.0}, "trainer": {"totalSteps": 0}})
    assert {p.split(":")[0] for p in problems} == {"spec.rollout.n", "spec.rollout.topP",
                                                   "spec.trainer.totalSteps"}


def test_manifest_and_overrides(tmp_path):
    manifest = {"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob",
                "metadata": {"name": "x"}, "spec": MINIMAL}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    spec = load_job_spec(path, ["data.train.path=/data/train.jsonl", "trainer.totalSteps=3"])
    assert spec.data.train.path == "/data/train.jsonl" and spec.trainer.total_steps == 3


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(DistflowConfigError, match="no such file"):
        load_job_spec(tmp_path / "nope.yaml")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(DistflowConfigError, match="expected path=value"):
        load_job_spec(path, ["data.train.path"])


@pytest.mark.parametrize("text, message", [
    ("- a\n- b\n", "expected a mapping"),
    ("42\n", "expected a mapping"),
    ("kind: RLPostTrainJob\nmetadata: {name: x}\n", "has no spec mapping"),
])
def test_files_that_are_not_a_spec_get_a_clear_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(DistflowConfigError, match=message):
        load_job_spec(path)
    with pytest.raises(DistflowConfigError, match="is a directory"):
        load_job_spec(tmp_path)


def test_examples_are_valid():
    # rayjob.yaml is a KubeRay manifest: tests/unit/test_rayjob_config.py validates the config it carries;
    # scaledobject.yaml is KEDA's (tests/unit/test_scaledobject_example.py).
    others = ("rayjob.yaml", "scaledobject.yaml")
    paths = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if p.name not in others]
    assert len(paths) >= 5
    for path in paths:
        load_job_spec(path)


def test_import_distflow_spec_does_not_import_torch():
    code = "import distflow, distflow.spec, distflow.planner, distflow.cli, distflow.data, sys; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_rejects_a_table_that_differs_from_the_declared_names():
    from distflow.names import registry

    fn = object()
    assert registry(("a", "b"), {"b": fn, "a": fn}, "family") == {"a": fn, "b": fn}
    with pytest.raises(ImportError, match=r"family: the registry maps \['a'\] but distflow.names declares \['a', 'b'\]"):
        registry(("a", "b"), {"a": fn}, "family")


def test_preflight_rejects_missing_data_file_and_cycle_before_workers(tmp_path):
    from distflow.preflight import preflight

    spec = parse_spec({**MINIMAL, "data": {"train": {"path": str(tmp_path / "nope.jsonl")}}})
    with pytest.raises(DistflowConfigError, match=r"spec.data.train.path: no such file"):
        preflight(spec)
    nodes = [{"id": "gen", "role": "rollout", "kind": "inference", "deps": ["train"]},
             {"id": "train", "role": "actor", "kind": "train", "deps": ["gen"]}]
    with pytest.raises(DistflowConfigError, match="cycle"):
        preflight(parse_spec({**MINIMAL, "workflow": {"nodes": nodes}}))
    preflight(parse_spec(MINIMAL))


def test_local_run_on_cuda_without_a_gpu_fails_before_any_worker(monkeypatch):
    import torch
    import torch.multiprocessing as mp

    from distflow.launcher import launch_local

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    spec = parse_spec({**MINIMAL, "cluster": {"device": "cuda"}})
    with pytest.raises(DistflowConfigError, match="spec.cluster.device: cuda requested but torch sees no GPU"):
        launch_local(spec, "job", progress=False)


@pytest.mark.parametrize("override, expected", [
    ("data.systemPrompt=Reply #1 only", "Reply #1 only"),
    ("data.systemPrompt=Answer: the number only", "Answer: the number only"),
    ("trainer.totalSteps=7", 7),
    ("rollout.val.temperature=0.5", 0.5),
    ("data.eval=null", None),
])
def test_set_values_are_yaml_scalars_and_text_stays_text(override, expected):
    from distflow.spec import apply_overrides

    doc = apply_overrides({"data": {}}, [override])
    key, _, _ = override.partition("=")
    node = doc
    for part in key.split("."):
        node = node[part]
    assert node == expected


def test_set_value_with_broken_brackets_and_binary_config_are_clear_errors(tmp_path):
    from distflow.spec import apply_overrides, load_job_spec

    with pytest.raises(DistflowConfigError, match=r"--set rollout.n: '\[1,2' is not a valid YAML list"):
        apply_overrides({}, ["rollout.n=[1,2"])
    binary = tmp_path / "config.yaml"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(DistflowConfigError, match="not a text file"):
        load_job_spec(binary)


def test_set_addresses_list_items_by_index_and_names_the_list_when_it_cannot(tmp_path):
    from distflow.spec import apply_overrides, load_job_spec

    doc = {"rollout": {"multiTurn": {"tools": [{"function": "m:f"}, {"function": "m:g"}]}}}
    apply_overrides(doc, ["rollout.multiTurn.tools.1.timeoutSeconds=5", "rollout.multiTurn.tools.0=m:h"])
    assert doc["rollout"]["multiTurn"]["tools"] == ["m:h", {"function": "m:g", "timeoutSeconds": 5}]
    for bad in ("rollout.multiTurn.tools.2.timeoutSeconds=5", "rollout.multiTurn.tools.name=x"):
        with pytest.raises(DistflowConfigError, match=r"rollout.multiTurn.tools is a list of 2 item\(s\); "
                                                      r"address one by its index 0..1"):
            apply_overrides(doc, [bad])
    with pytest.raises(DistflowConfigError, match=r"--set rollout.multiTurn.tools.1.function.x: "
                                                  r"rollout.multiTurn.tools.1.function is 'm:g', not a mapping"):
        apply_overrides(doc, ["rollout.multiTurn.tools.1.function.x=1"])
    # the shipped example, through the loader a user calls
    spec = load_job_spec("examples/multiturn_calculator.yaml",
                         ["rollout.multiTurn.tools.0.toolSchema.function.description=Adds numbers."])
    assert spec.rollout.multi_turn.tools[0].tool_schema.function.description == "Adds numbers."


def test_group_estimator_with_one_response_per_prompt_is_rejected():
    with pytest.raises(DistflowConfigError, match="spec.rollout.n: grpo compares each response"):
        parse_spec({**MINIMAL, "rollout": {"n": 1}})
    parse_spec({**MINIMAL, "rollout": {"n": 1}, "algorithm": {"advantageEstimator": "reinforce_plus_plus"}})


def test_preflight_checks_reward_function_and_data_format(tmp_path):
    from distflow.preflight import preflight

    with pytest.raises(DistflowConfigError, match="spec.data.rewardFn: reward 'no_such_module:f'"):
        preflight(parse_spec({**MINIMAL, "data": {**MINIMAL["data"], "rewardFn": "no_such_module:f"}}))
    table = tmp_path / "train.csv"
    table.write_text("question,answer\n")
    with pytest.raises(DistflowConfigError, match=r"spec.data.train.path: .*train.csv' is not a .jsonl"):
        preflight(parse_spec({**MINIMAL, "data": {"train": {"path": str(table)}}}))
    with pytest.raises(DistflowConfigError, match="exactly one node must have role rollout"):
        preflight(parse_spec({**MINIMAL, "workflow": {"nodes": []}}))


def test_preflight_rejects_model_paths_no_worker_could_load(tmp_path):
    from distflow.preflight import preflight

    for path, message in ((str(tmp_path / "nope"), "not a local directory"), (str(tmp_path), "no config.json"),
                          ("gguf:/nope.gguf", "no such file")):
        with pytest.raises(DistflowConfigError, match=f"spec.model.path .*{message}"):
            preflight(parse_spec({**MINIMAL, "model": {"path": path}}))
    preflight(parse_spec({**MINIMAL, "model": {"path": "org/name"}}))  # a hub id: checked when downloaded


@pytest.mark.parametrize("cluster, expected", [
    ({"numNodes": 1, "minNodes": 2}, ["spec.cluster.numNodes: 1 is below cluster.minNodes=2; "
                                      "use at least 2 or lower minNodes"]),
    ({"numNodes": 8, "maxNodes": 4}, ["spec.cluster.numNodes: 8 is above cluster.maxNodes=4; "
                                      "use at most 4 or raise maxNodes"]),
    ({"numNodes": 2, "minNodes": 3, "maxNodes": 2}, ["spec.cluster.minNodes: 3 is above cluster.maxNodes=2; "
                                                     "use at most 2"]),
])
def test_resize_bounds_hold_num_nodes(cluster, expected):
    assert _problems({**MINIMAL, "cluster": cluster}) == expected
    spec = parse_spec({**MINIMAL, "cluster": {"numNodes": 2, "minNodes": 2, "maxNodes": 4}})
    assert (spec.cluster.min_nodes, spec.cluster.num_nodes, spec.cluster.max_nodes) == (2, 2, 4)


def test_kubernetes_quantities_and_tolerations_the_api_server_takes_pass():
    parse_spec({**MINIMAL, "template": {
        "resources": {"requests": {"cpu": "500m", "memory": "4Gi", "ephemeral-storage": "1e9", "hugepages-2Mi": "1Gi"},
                      "limits": {"cpu": 2, "memory": "4096M", "example.com/fpga": "1", "example.com/x": "1.5Ki"}},
        "tolerations": [{"operator": "Exists"}, {"key": "gpu", "operator": "Equal", "value": "a100",
                                                 "effect": "NoSchedule"}, {"key": "spot", "effect": "NoExecute",
                                                                           "tolerationSeconds": 30},
                        {"key": "a", "operator": "", "value": "b"}, {"key": "c", "operator": None}]}})


def test_node_ids_the_runtime_times_itself_are_refused():
    from distflow.planner import build_plan

    def nodes(actor_id):
        return [{"id": "gen", "role": "rollout", "kind": "inference"},
                {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
                {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["score"]},
                {"id": actor_id, "role": "actor", "kind": "train", "deps": ["adv"]}]

    def plan(actor_id, **extra):
        return build_plan(parse_spec({**MINIMAL, "algorithm": {"useKlLoss": False},
                                      "workflow": {"nodes": nodes(actor_id)}, **extra}))

    with pytest.raises(DistflowConfigError, match=r"spec.workflow.nodes\[3\].id: 'step' names the step's own time "
                                                  r"\(timing_s/step: the step duration and throughput\); rename "
                                                  r"the node \(e.g. actor_step\)"):
        plan("step")
    plan("train")  # sync mode times no pool
    pooled = {"cluster": {"numNodes": 2}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
              "async": {"enable": True, "offPolicyCorrection": "none", "rolloutPool": {"numNodes": 1}}}
    with pytest.raises(DistflowConfigError, match=r"nodes\[3\].id: 'train' names the trainer pool's time per step"):
        plan("train", **pooled)
    assert plan("update", **pooled).pooled


def test_preflight_refuses_fewer_training_prompts_than_one_batch(tmp_path):
    from distflow.preflight import preflight

    with pytest.raises(DistflowConfigError, match=r"spec.data.train: 2 prompts, fewer than one batch "
                                                  r"\(data.trainBatchSize=4\); lower data.trainBatchSize to at "
                                                  r"most 2 or raise data.train.size"):
        preflight(parse_spec({**MINIMAL, "data": {"train": {"path": "arithmetic", "size": 2}, "trainBatchSize": 4}}))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(f'{{"question": "{i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(3)))
    with pytest.raises(DistflowConfigError, match=r"3 prompts, fewer than one batch .* or give a file with more"):
        preflight(parse_spec({**MINIMAL, "data": {"train": {"path": str(small)}, "trainBatchSize": 4}}))
    preflight(parse_spec({**MINIMAL, "data": {"train": {"path": str(small)}, "trainBatchSize": 3}}))


@pytest.mark.parametrize("text, line, key, first", [
    ("model: {path: tiny}\ndata: {train: {path: arithmetic}}\ncluster:\n  numNodes: 2\n  maxNodes: 4\n"
     "cluster:\n  numNodes: 1\n", 6, "cluster", 3),
    ("model: {path: tiny}\ndata: {train: {path: arithmetic, size: 8, size: 16}}\n", 2, "size", 2),
])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, text, line, key, first):
    config = tmp_path / "job.yaml"
    config.write_text(text)
    with pytest.raises(DistflowConfigError, match=rf"job.yaml: line {line}: the key '{key}' is given twice "
                                                  rf"\(first on line {first}\)"):
        load_job_spec(config)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("model: {path: tiny}\ndata: {train: {path: arithmetic}, trainBatchSize: 4}\n"
                      "cluster: {<<: {numNodes: 1, procsPerNode: 1}, numNodes: 2}\n")
    assert load_job_spec(config).cluster.num_nodes == 2


def test_validate_warns_that_async_settings_without_async_enable_are_ignored(tmp_path, capsys):
    from distflow import cli

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({**MINIMAL, "async": {"maxStaleness": 3, "rolloutPool": {"numNodes": 1}}}))
    assert cli.main(["validate", str(config)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("distflow: warning: async.maxStaleness, async.rolloutPool: ignored, as async.enable is "
                            "false (the job trains synchronously); set async.enable: true for two pools, or remove "
                            "them\n")
    assert "workflow grpo" in captured.out
    config.write_text(yaml.safe_dump({**MINIMAL, "async": {"enable": False}, "workflow": {"name": None}}))
    assert cli.main(["validate", str(config)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "workflow grpo" in captured.out
