"""The run's last line (``distflow run``): the held-out score before and after, or, with no
held-out set, the step reached and where the metrics and checkpoints lie."""

import json

import pytest

from distflow.cli import run_summary
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _spec(tmp_path, **data):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, **data},
                       "trainer": {"totalSteps": 4, "logDir": str(tmp_path / "run")},
                       "checkpoint": {"dir": str(tmp_path / "run" / "ck")}})


def _write(tmp_path, records):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_with_a_held_out_set_it_compares_the_score_before_and_after(tmp_path):
    _write(tmp_path, [{"training/step": 0, "eval/score": 0.125}, {"training/step": 1},
                      {"training/step": 2, "eval/score": 0.5}])
    assert run_summary(_spec(tmp_path)) == (
        f"eval score: before 0.125 -> after 0.500 (2 evaluations; metrics in {tmp_path}/run/metrics.jsonl)")


def test_without_a_held_out_set_it_says_the_step_reached_and_where_the_output_is(tmp_path):
    _write(tmp_path, [{"training/step": 1}, {"training/step": 2}, {"training/step": 3}])
    assert run_summary(_spec(tmp_path, eval=None)) == (
        f"trained to step 3 of 4; metrics in {tmp_path}/run/metrics.jsonl, checkpoints in {tmp_path}/run/ck "
        "(no held-out score: data.eval is not set)")


def test_nothing_to_say_without_a_metrics_file(tmp_path):
    assert run_summary(_spec(tmp_path)) is None


def test_a_run_whose_checkpoint_is_past_total_steps_says_so_not_step_5_of_4(tmp_path):
    """A run that trained 5 steps, started again with totalSteps 4 ("nothing to train")."""
    _write(tmp_path, [{"training/step": s} for s in range(1, 6)])
    assert run_summary(_spec(tmp_path, eval=None)) == (
        f"trained to step 5, past trainer.totalSteps (4); metrics in {tmp_path}/run/metrics.jsonl, checkpoints "
        f"in {tmp_path}/run/ck (no held-out score: data.eval is not set)")
