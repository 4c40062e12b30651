"""Resuming drops what a killed run logged past its checkpoint, so each step is logged once."""

import json

import pytest

from distflow.metrics import JsonlWriter, read_jsonl


def test_drop_after_keeps_steps_up_to_the_checkpoint(tmp_path):
    writer = JsonlWriter(tmp_path)
    for step in (0, 1, 2, 3):  # step 0: the eval before training; the run died after step 3
        writer.write({"training/step": step, "critic/score/mean": step / 10})
    (tmp_path / "eval_samples.jsonl").write_text(
        "".join(json.dumps({"step": s, "response": "r"}) + "\n" for s in (0, 0, 3)))
    assert writer.drop_after(2) == 2
    assert [r["training/step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval_samples.jsonl")] == [0, 0]
    writer.write({"training/step": 3, "critic/score/mean": 0.5})
    assert [r["training/step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert writer.drop_after(3) == 0


@pytest.mark.parametrize("resumed_at, kept", [(0, []), (2, [0, 1, 2])])
def test_a_run_that_resumes_at_step_0_keeps_none_of_the_killed_runs_lines(tmp_path, monkeypatch, resumed_at, kept):
    """Resumed at step 0 (no usable checkpoint), the run logs its step-0 evaluation again: the killed
    run's must go too, or the summary would count it twice and read "before" from the older run."""
    from types import SimpleNamespace

    from distflow import checkpoint
    from distflow.worker import DagWorker

    writer = JsonlWriter(tmp_path)
    for step in range(4):
        writer.write({"training/step": step})
    monkeypatch.setattr(checkpoint, "load", lambda root, name, worker: resumed_at)
    spec = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path / "ckpt")),
                           trainer=SimpleNamespace(total_steps=4, log_dir=str(tmp_path)))
    worker = SimpleNamespace(spec=spec, resume_from=None, writer=writer, is_logger=False, exporter=None,
                             _resuming=lambda: True)
    DagWorker._resume(worker)
    assert [r["training/step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == kept
