"""data.truncation on a real local job (2 gloo workers, tiny model).

The limit is set to the median prompt length (chat template included, as
the rollout renders it), so about half the prompts are over-long: with the
default ``error`` the job stops before its first step naming the field;
with ``filter`` it trains on the rest and logs how many were dropped.
"""

import pytest
from _jobs import run_job, tiny_job_spec
from distflow.launcher import launch_local

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def _lengths(spec) -> list[int]:
    from distflow.data.sources import open_source
    from distflow.engines.rollout import render_prompt
    from distflow.models import load_tokenizer, resolve_model
    from distflow.models import model_cache_dir

    tokenizer = load_tokenizer(resolve_model(spec.model.path, model_cache_dir()))
    source = open_source(spec.data.train.path)
    return [len(render_prompt(tokenizer, r)) for r in source.read(range(source.num_records))]


def _spec(tmp_path, name, **data):
    spec = tiny_job_spec(tmp_path, name, trainer={"totalSteps": 1})
    limit = sorted(_lengths(spec))[len(_lengths(spec)) // 2]
    return tiny_job_spec(tmp_path, name, trainer={"totalSteps": 1},
                         data={"maxPromptLength": limit, **data}), limit


def test_overlong_prompt_stops_the_job_before_training_naming_the_field(tmp_path):
    spec, limit = _spec(tmp_path, "error")
    with pytest.raises(Exception) as err:
        launch_local(spec, "error", progress=False)
    assert "spec.data.train: " in str(err.value) and f"data.maxPromptLength={limit}" in str(err.value)
    assert not (tmp_path / "error" / "metrics.jsonl").exists()


def test_filter_drops_the_overlong_prompts_and_counts_them(tmp_path):
    spec, limit = _spec(tmp_path, "filter", truncation="filter")
    expected = sum(n > limit for n in _lengths(spec))
    assert 0 < expected < 64
    _, log = run_job(spec, "filter")
    assert log[-1]["data/filtered_prompts"] == expected
    assert log[-1]["prompt_length/mean"] <= limit
