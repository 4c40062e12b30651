"""Elastic resume: a checkpoint written by 2 nodes x 2 workers continues on 1 node x 2.

torch.distributed.checkpoint reshards the actor and its Adam state from 4
FSDP shards onto 2; the dataloader state is global, so the new size trains
on the same prompts the old size would have (no repeat, no skip); rollout
sampling is seeded per global sample, so it also samples the same responses.

Asserted:
- reproducible at the new size: killed again at the new size and resumed, the
  run ends bit-identical (parameters and Adam state) to an uninterrupted run
  at the new size from the same checkpoint;
- the same sample stream: at steps 3 and 4 both trained on exactly the record
  ids the 2 x 2 run trained on (each prompt n times);
- the same responses in the first step at the new size (step 3): response
  lengths and rewards equal the 2 x 2 run's, and the parameters after it
  differ from the 2 x 2 run's only by float rounding (``TOLERANCE``). Later
  steps are not compared: sampling is a discontinuous function of the
  weights, and a rounding-level difference in them may flip a draw that lies
  near a boundary of the sampling distribution, after which the runs diverge
  as any two differently sampled runs do.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from distflow import sample_ids
from distflow.metrics import read_jsonl
from tests.dist._jobs import run_job, tiny_job_spec

# long (~1.5 min on 2 cores): the default run resumes at other world sizes on pods, no sample lost or
# repeated and the parameters those of a run resumed by hand (tests/e2e/test_e2e_resize.py).
pytestmark = [pytest.mark.dist, pytest.mark.chaos, pytest.mark.long, pytest.mark.timeout(1800)]

STEPS = {"totalSteps": 4}
# Step 3 at 4 vs 2 workers differs only in how sums are split over ranks and micro-batches
# (float32 reduction order, ~1e-7 relative in each gradient). Adam divides by sqrt(v), so a
# parameter moves by at most about lr = 1e-3 per step whatever its gradient; the rounding moves
# it by orders of magnitude less. A different response (what per-rank rollout seeds gave)
# moves most parameters by ~lr.
TOLERANCE = 1e-5


def _spec(tmp_path, name, nodes, procs):
    return tiny_job_spec(tmp_path, name, trainer=STEPS, cluster={"numNodes": nodes, "procsPerNode": procs},
                         checkpoint={"saveEverySteps": 1, "keepLast": 4})


def _from_checkpoint(tmp_path, name, source):
    """A 1 x 2 job whose checkpoint directory starts with a copy of ``source``."""
    spec = _spec(tmp_path, name, 1, 2)
    shutil.copytree(source, os.path.join(spec.checkpoint.dir, source.name))
    return spec


def _rollout_figures(records: list[dict]) -> dict[int, tuple[float, float]]:
    return {r["training/step"]: (r["response_length/mean"], r["critic/score/mean"]) for r in records}


def test_resume_on_another_world_size_continues_the_same_sample_stream(tmp_path, capfd):
    old = _spec(tmp_path, "old_2x2", 2, 2)
    run_job(old)
    old_ckpt = tmp_path / "old_2x2" / "ckpt"
    source = old_ckpt / "step_00000002"
    old_ids = sample_ids.read(old.trainer.log_dir)

    straight = _from_checkpoint(tmp_path, "new_straight", source)
    capfd.readouterr()
    straight_state, straight_log = run_job(straight)
    assert "written by 4 workers and is resharded onto 2" in capfd.readouterr().out
    killed = _from_checkpoint(tmp_path, "new_killed", source)
    os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"] = "4"  # dies in step 4, after the 1 x 2 checkpoint of step 3
    try:
        with pytest.raises(Exception, match="injected failure"):
            run_job(killed)
    finally:
        del os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"]
    killed_state, killed_log = run_job(killed)

    for key in straight_state["model"]:
        assert torch.equal(straight_state["model"][key], killed_state["model"][key]), key
    for key, value in straight_state["optim"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, killed_state["optim"]["state"][key][name]), (key, name)
    assert [r["training/step"] for r in killed_log] == [3, 4] == [r["training/step"] for r in straight_log]
    for spec in (straight, killed):  # the prompts the 2 x 2 run trained on at steps 3 and 4, each n times
        assert sample_ids.read(spec.trainer.log_dir) == {3: old_ids[3], 4: old_ids[4]}
    assert len(old_ids[3]) == 4 * 2 and old_ids[3] != old_ids[4]

    old_figures = _rollout_figures(read_jsonl(f"{old.trainer.log_dir}/metrics.jsonl"))
    assert _rollout_figures(straight_log)[3] == pytest.approx(old_figures[3], rel=1e-12)
    at_2, old_3 = _params(source), _params(old_ckpt / "step_00000003")
    new_3 = _params(tmp_path / "new_straight" / "ckpt" / "step_00000003")
    diff = max((new_3[k] - old_3[k]).abs().max().item() for k in old_3)
    moved = max((old_3[k] - at_2[k]).abs().max().item() for k in old_3)
    print(f"elastic 2x2 -> 1x2, step 3: max |parameter difference| vs the 2x2 run {diff:.3g} "
          f"(tolerance {TOLERANCE}); the step moved parameters by up to {moved:.3g}")
    assert diff <= TOLERANCE and moved > 10 * TOLERANCE


def _params(checkpoint_dir) -> dict[str, torch.Tensor]:
    """The actor's parameters in a checkpoint directory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint_dir.parent / f"{checkpoint_dir.name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    return torch.load(out, weights_only=False)["model"]
