"""The operator/worker version-skew contract: what the operator renders into the job's ConfigMap an
older worker image reads, and a worker reads what a newer operator renders (docs/operations.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from distflow import cli
from distflow.spec import (
    SPEC_SCHEMA_VERSION, dump_spec, load_job_spec, load_rendered_spec, parse_spec,
)
from distflow.spec.defaults import resolve_device_defaults
from distflow_operator.render import JobRef, build_config_map
from tests.previous_release import previous_spec_package

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = ["rljob.yaml", "quickstart.yaml", "gsm8k-grpo.yaml", "ppo.yaml", "dapo.yaml"]
MINIMAL = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
           "cluster": {"numNodes": 2}}


@pytest.fixture(scope="module")
def previous_spec(tmp_path_factory):
    return previous_spec_package(tmp_path_factory.mktemp("previous"))


def _rendered(spec) -> str:
    return build_config_map(spec, JobRef("job", "ns", "uid"))["data"]["spec.yaml"]


def _values_at(full: dict, known: dict, path=()) -> list[tuple]:
    """(path, today's value, the older package's value) wherever the older package knows the field."""
    out = []
    for key, old in known.items():
        new = full.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += _values_at(new, old, path + (key,))
        else:
            out.append((path + (key,), new, old))
    return out


# Not gsm8k-grpo.yaml: it sets data.truncation, which the previous release lacks; a job that sets a new
# field needs a new image, and the older one says which field (the contract's documented limit).
@pytest.mark.parametrize("example", [e for e in EXAMPLES if e != "gsm8k-grpo.yaml"])
def test_the_previous_release_reads_what_this_operator_renders(example, previous_spec, tmp_path):
    spec = load_job_spec(REPO / "examples" / example)
    path = tmp_path / "spec.yaml"
    path.write_text(_rendered(spec))
    older = previous_spec.load_job_spec(path)
    # The older worker runs the same job: every field it knows has today's value, once today's
    # device-dependent defaults ("auto") are settled as a CPU worker settles them; on a GPU an older
    # image keeps its own defaults (fp32, 64 rollout sequences), the contract's other documented limit.
    today = resolve_device_defaults(spec, "cpu")
    differ = [(p, new, old) for p, new, old in _values_at(dump_spec(today), older.model_dump(
        mode="json", by_alias=True, exclude_none=True)) if new != old]
    assert differ == []


def test_the_rendered_spec_holds_what_differs_from_the_defaults_and_the_schema_version():
    spec = parse_spec({**MINIMAL, "rollout": {"temperature": 1.0}, "runPolicy": {"maxRestarts": 3}})
    document = yaml.safe_load(_rendered(spec))
    assert document == {"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob",
                        "schemaVersion": SPEC_SCHEMA_VERSION, "spec": MINIMAL}


@pytest.mark.parametrize("spec", [
    *[{"example": name} for name in EXAMPLES],
    # Values equal to a field's default but not to what the workflow implies must stay in the render.
    {**MINIMAL, "workflow": {"name": "ppo"}, "algorithm": {"useKlLoss": True}},
    {**MINIMAL, "workflow": {"name": "dapo"}, "algorithm": {"filterGroups": {"enable": False}, "clipRatioHigh": 0.2}},
])
def test_the_rendered_spec_parses_back_to_the_same_spec(spec, tmp_path):
    parsed = load_job_spec(REPO / "examples" / spec["example"]) if "example" in spec else parse_spec(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(_rendered(parsed))
    assert load_rendered_spec(path) == (parsed, [])
    assert load_job_spec(path) == parsed


def _from_a_newer_operator(tmp_path) -> Path:
    document = yaml.safe_load(_rendered(parse_spec(MINIMAL)))
    document["schemaVersion"] = SPEC_SCHEMA_VERSION + 1
    document["spec"]["rollout"] = {"fieldFromANewerRelease": 3}
    document["spec"]["sectionFromANewerRelease"] = {"enable": True}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_worker_ignores_and_names_the_fields_a_newer_operator_renders(tmp_path):
    spec, warnings = load_rendered_spec(_from_a_newer_operator(tmp_path))
    assert spec == parse_spec(MINIMAL)
    assert warnings == [
        "ignoring fields this worker image does not know: spec.rollout.fieldFromANewerRelease, "
        f"spec.sectionFromANewerRelease (the operator rendered spec schema {SPEC_SCHEMA_VERSION + 1}, this "
        f"image reads {SPEC_SCHEMA_VERSION}); use a newer worker image (spec.template.image) for them to take effect"]


def test_distflow_node_runs_a_spec_with_unknown_fields_and_warns(tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr("distflow.launcher.launch_node", lambda spec, name, spec_dir: launched.append(spec))
    assert cli.main(["node", "--config", str(_from_a_newer_operator(tmp_path))]) == 0
    assert launched == [parse_spec(MINIMAL)]
    assert "distflow: warning: ignoring fields this worker image does not know" in capsys.readouterr().err


def test_a_users_own_config_still_rejects_an_unknown_field(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "rollout": {"temprature": 0.7}}))
    assert cli.main(["validate", str(path)]) == 2
    assert "spec.rollout.temprature: unknown field" in capsys.readouterr().err
