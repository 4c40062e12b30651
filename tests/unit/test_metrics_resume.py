"""Resuming drops what a killed run logged past its checkpoint, so each step is logged once."""

import json

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
