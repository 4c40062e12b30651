"""A new user's bad input, caught before any worker starts, naming the field and the fix;
and a user's function that raises mid-run, named with its sample and step."""

import json

import pytest
import yaml

from distflow.errors import DistflowConfigError
from distflow.preflight import preflight
from distflow.spec import load_job_spec, parse_spec

pytestmark = pytest.mark.unit

MINIMAL = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}}}
GSM8K_ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


def _with_train_file(path) -> dict:
    return {**MINIMAL, "data": {"train": {"path": str(path)}}}


def _preflight_message(doc) -> str:
    with pytest.raises(DistflowConfigError) as err:
        preflight(parse_spec(doc))
    return str(err.value)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_greedy_sampling_with_group_advantages_is_rejected(estimator):
    doc = {**MINIMAL, "rollout": {"n": 4, "temperature": 0}, "algorithm": {"advantageEstimator": estimator}}
    with pytest.raises(DistflowConfigError) as err:
        parse_spec(doc)
    assert err.value.problems == [
        f"spec.rollout.temperature: 0 is greedy, so the 4 responses of a prompt are identical and every "
        f"{estimator} advantage is 0 (nothing is learned); sample with a temperature > 0 (1.0 is usual)"]
    # Greedy is fine where nothing compares responses within a group.
    parse_spec({**MINIMAL, "rollout": {"n": 1, "temperature": 0},
                "algorithm": {"advantageEstimator": "reinforce_plus_plus"}})


MANIFEST = """apiVersion: distflow.io/v1alpha1
kind: RLPostTrainJob
metadata: {name: grpo-tiny}
spec:
  model: {path: tiny}
  data: {train: {path: arithmetic}, trainBatchSize: 4}
  rollout:
    "n": 2
"""


@pytest.mark.parametrize("old, new, problem", [
    ("apiVersion: distflow.io/v1alpha1", "apiVersion: distflow.io/v2",
     "apiVersion: 'distflow.io/v2' is not served for RLPostTrainJob; write apiVersion: distflow.io/v1alpha1"),
    ("apiVersion: distflow.io/v1alpha1\n", "",
     "apiVersion: None is not served for RLPostTrainJob; write apiVersion: distflow.io/v1alpha1"),
    ("metadata: {name: grpo-tiny}", "metadata: {}",
     "metadata.name: missing; give the job a name (e.g. metadata: {name: grpo-tiny})"),
    ("name: grpo-tiny", "name: Grpo_Tiny",
     "metadata.name: 'Grpo_Tiny' must start with a letter, contain only a-z, 0-9 and '-', and be at most 53 "
     "characters (it names the Service and the pods <name>-node-<rank>)"),
    ('"n": 2', "n: 2", 'line 8: the key n is unquoted, and kubectl reads a bare n as a boolean; quote it: "n":'),
])
def test_a_manifest_the_api_server_would_refuse_fails_validation(tmp_path, old, new, problem):
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST)
    assert load_job_spec(manifest).rollout.n == 2
    manifest.write_text(MANIFEST.replace(old, new))
    with pytest.raises(DistflowConfigError) as err:
        load_job_spec(manifest)
    assert err.value.problems == [f"{manifest}: {problem}"]


def test_a_file_of_several_documents_is_named_as_such(tmp_path):
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text(MANIFEST + "---\n" + MANIFEST)
    with pytest.raises(DistflowConfigError, match=r"holds several YAML documents \(---\); distflow reads one"):
        load_job_spec(bundle)


def test_a_misspelled_kind_is_reported_as_the_kind(tmp_path):
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJobs",
                                        "metadata": {"name": "x"}, "spec": MINIMAL}))
    with pytest.raises(DistflowConfigError) as err:
        load_job_spec(manifest)
    assert err.value.problems == [
        f"{manifest}: kind: 'RLPostTrainJobs' is not a kind distflow reads; a manifest's kind is RLPostTrainJob "
        "(apiVersion distflow.io/v1alpha1); a local run config has no kind or apiVersion"]


def test_empty_data_file_is_rejected_before_workers(tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("\n\n")
    assert (f"spec.data.train.path: {str(empty)!r} has no records (the file is empty)"
            in _preflight_message(_with_train_file(empty)))


def test_data_file_that_is_not_json_lines_is_rejected_before_workers(tmp_path):
    csv = tmp_path / "train.jsonl"
    csv.write_text("question,answer\nWhat is 2 + 3?,5\n")
    message = _preflight_message(_with_train_file(csv))
    assert f"spec.data.train.path: {str(csv)!r} is not JSON lines (" in message
    assert "write one JSON object per line" in message


def test_a_json_array_and_a_directory_are_named_for_what_they_are(tmp_path):
    array = tmp_path / "train.json"
    array.write_text(json.dumps([GSM8K_ROW, GSM8K_ROW]))
    assert (f"spec.data.train.path: {str(array)!r} holds one JSON array, not JSON lines; write one JSON object "
            "per line (e.g. jq -c '.[]')") in _preflight_message(_with_train_file(array))
    assert (f"spec.data.train.path: {str(tmp_path)!r} is a directory; give one .jsonl or .parquet file in it "
            f"(e.g. --set data.train.path={tmp_path / 'train.jsonl'})") in _preflight_message(_with_train_file(tmp_path))


def test_data_file_without_a_prompt_field_is_rejected_before_workers(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"text": "What is 2 + 3?", "label": "5"}) + "\n")
    message = _preflight_message(_with_train_file(rows))
    assert f"spec.data.train.path: {str(rows)!r} has records distflow cannot read" in message
    assert "keys ['label', 'text']" in message and "verl: ['data_source', 'prompt', 'reward_model']" in message


def test_parquet_files_are_read_before_workers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fake = tmp_path / "train.parquet"
    fake.write_text("not parquet at all")
    assert f"spec.data.train.path: {str(fake)!r} is not a readable parquet file" in _preflight_message(
        _with_train_file(fake))
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"text": ["hi"]}), wrong)
    assert "has records distflow cannot read" in _preflight_message(_with_train_file(wrong))
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW] * 8), good)  # one batch (data.trainBatchSize 8)
    preflight(parse_spec(_with_train_file(good)))


def test_a_custom_node_function_is_import_checked(tmp_path):
    nodes = [{"id": "gen", "role": "rollout", "kind": "inference"},
             {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
             {"id": "mine", "role": "custom", "kind": "compute", "deps": ["score"],
              "function": "no_such_module_xyz:reshape"},
             {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["mine"]},
             {"id": "train", "role": "actor", "kind": "train", "deps": ["adv"]}]
    doc = {**MINIMAL, "algorithm": {"useKlLoss": False}, "workflow": {"nodes": nodes}}
    message = _preflight_message(doc)
    assert ("spec.workflow.nodes[2].function: workflow node 'mine' function 'no_such_module_xyz:reshape': "
            "cannot import module 'no_such_module_xyz'") in message
    user = tmp_path / "nodes.py"
    user.write_text("def reshape(batch):\n    return batch\n")
    nodes[2]["function"] = f"{user}:reshap"
    assert "module" in _preflight_message(doc) and "has no function 'reshap'; it has ['reshape']" in \
        _preflight_message(doc)
    nodes[2]["function"] = f"{user}:reshape"
    preflight(parse_spec(doc))


def test_a_reward_function_that_raises_names_itself_the_sample_and_the_step(tmp_path):
    from distflow.data.records import PromptRecord
    from distflow.rewards import compute_scores
    from distflow.errors import UserFunctionError

    user = tmp_path / "picky.py"
    user.write_text("def score(response, ground_truth, extra_info):\n"
                    "    return 1.0 if response == ground_truth else int(response)\n")
    records = [PromptRecord(uid=f"train-{i}", messages=({"role": "user", "content": "2+3?"},), ground_truth="5",
                            data_source="arithmetic", extra_info={}) for i in range(3)]
    ref = f"{user}:score"
    assert compute_scores(["5", "7", "5"], records, ref, "at step 3") == [1.0, 7.0, 1.0]
    with pytest.raises(UserFunctionError) as err:
        compute_scores(["5", "five", "5"], records, ref, "at step 3")
    assert str(err.value).startswith(
        f"data.rewardFn {ref!r} raised ValueError: invalid literal for int() with base 10: 'five' at step 3 "
        "on sample train-1 (ground truth '5', response 'five'); fix the function")


def _checkpoint_made_from(root, step: int, made_from: dict) -> None:
    """A complete checkpoint as far as the resume check reads it: trainer.json and .metadata in its manifest."""
    ckpt = root / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": step, "made_from": made_from}))
    (ckpt / ".metadata").write_bytes(b"x")
    files = {name: {"size": (ckpt / name).stat().st_size, "sha256": ""} for name in ("trainer.json", ".metadata")}
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": files}))


def test_resuming_under_another_model_or_workflow_is_refused_naming_what_changed(tmp_path):
    from distflow.checkpoint_origin import check_resume, made_from

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 300}))
    doc = {**MINIMAL, "checkpoint": {"dir": str(tmp_path / "ckpt")}}
    spec = parse_spec(doc)
    recorded = made_from(spec, model)
    assert recorded == {"model.path": "tiny", "critic": False, "model shape": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}}
    _checkpoint_made_from(tmp_path / "ckpt", 3, recorded)
    check_resume(spec, model)  # the same run: resumes

    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 300}))
    ppo = parse_spec({**doc, "model": {"path": "other"}, "workflow": {"name": "ppo"},
                      "algorithm": {"advantageEstimator": "gae"}})
    with pytest.raises(DistflowConfigError) as err:
        check_resume(ppo, model)
    assert err.value.problems == [
        f"spec.checkpoint.dir: the step-3 checkpoint at {tmp_path / 'ckpt' / 'step_00000003'} cannot resume this "
        "run: model.path: the checkpoint was made with 'tiny', this run has 'other'; critic: the checkpoint was "
        "made with False, this run has True; model shape: the checkpoint was made with {'model_type': 'llama', "
        "'hidden_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'vocab_size': 300}, this run has "
        "{'model_type': 'llama', 'hidden_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4, "
        "'vocab_size': 300}. Put the setting back to continue that run, or start over: distflow run --no-resume "
        "(moves the old run aside) or another checkpoint.dir"]
    check_resume(parse_spec({**doc, "checkpoint": {**doc["checkpoint"], "resume": "never"}}), model)


def test_validate_refuses_a_run_its_checkpoint_cannot_resume(tmp_path, capsys):
    from distflow import cli

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**MINIMAL, "checkpoint": {"dir": str(tmp_path / "ckpt")}}))
    _checkpoint_made_from(tmp_path / "ckpt", 2, {"model.path": "smollm2", "critic": False})
    assert cli.main(["validate", str(config)]) == 2
    assert ("model.path: the checkpoint was made with 'smollm2', this run has 'tiny'"
            in capsys.readouterr().err)
    assert cli.main(["validate", str(config), "--set", "model.path=smollm2"]) == 0


def test_the_operator_fails_a_custom_workflow_the_planner_rejects_before_any_pod():
    from distflow_operator.observed import job_view

    nodes = [{"id": "gen", "role": "rollout", "kind": "inference", "deps": ["train"]},
             {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
             {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["score"]},
             {"id": "train", "role": "actor", "kind": "train", "deps": ["adv"]}]
    spec = {**MINIMAL, "algorithm": {"useKlLoss": False}, "workflow": {"nodes": nodes}}
    view = job_view({"metadata": {"name": "cyclic"}, "spec": spec})
    assert view.spec is None
    assert [p.split(":")[0] for p in view.problems] == ["spec.workflow.nodes"], view.problems
    assert "cycle" in view.problems[0]
    assert job_view({"metadata": {"name": "fine"}, "spec": {**spec, "workflow": {"nodes": [
        {**n, "deps": []} if n["id"] == "gen" else n for n in nodes]}}}).problems == ()
