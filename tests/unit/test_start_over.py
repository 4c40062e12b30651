"""--no-resume moves the previous run's checkpoints and logs aside instead of mixing runs."""

import pytest

from distflow.launcher import set_aside_previous_run
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _spec(tmp_path):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "trainer": {"logDir": str(tmp_path / "run")},
                       "checkpoint": {"dir": str(tmp_path / "run" / "checkpoints")}})


def test_previous_run_is_moved_aside_and_replaced_next_time(tmp_path):
    spec = _spec(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000030").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"training/step": 30}\n')
    (run / "eval_samples.jsonl").write_text("{}\n")
    (run / "trained_ids.jsonl").write_text('{"step": 30, "ids": [1, 2]}\n')
    moved = set_aside_previous_run(spec)
    assert sorted(p.name for p in moved) == ["checkpoints.previous", "eval_samples.jsonl.previous",
                                              "metrics.jsonl.previous", "trained_ids.jsonl.previous"]
    assert not (run / "trained_ids.jsonl").exists()  # the new run's ids are not appended to the old run's
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert (run / "checkpoints.previous" / "step_00000030").is_dir()
    # A second start-over replaces the older .previous with the run just ended.
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"training/step": 10}\n')
    set_aside_previous_run(spec)
    assert [p.name for p in (run / "checkpoints.previous").iterdir()] == ["step_00000010"]
    assert (run / "metrics.jsonl.previous").read_text() == '{"training/step": 10}\n'
    assert not (run / "eval_samples.jsonl.previous").exists()  # from two runs ago: gone


def test_nothing_to_move(tmp_path):
    assert set_aside_previous_run(_spec(tmp_path)) == []
