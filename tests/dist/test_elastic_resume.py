"""Elastic resume: a checkpoint written by 2 nodes x 2 workers continues on 1 node x 2.

torch.distributed.checkpoint reshards the actor and its Adam state from 4
FSDP shards onto 2; the dataloader state is global, so the new size trains
on the same prompts the old size would have (no repeat, no skip). The
continued run is reproducible: killed again at the new size and resumed,
it ends bit-identical to an uninterrupted run at the new size from the
same checkpoint.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from distflow import sample_ids
from tests.dist._jobs import run_job, tiny_job_spec

pytestmark = [pytest.mark.dist, pytest.mark.chaos, pytest.mark.timeout(1800)]

STEPS = {"totalSteps": 4}


def _spec(tmp_path, name, nodes, procs, save_every):
    return tiny_job_spec(tmp_path, name, trainer=STEPS, cluster={"numNodes": nodes, "procsPerNode": procs},
                         checkpoint={"saveEverySteps": save_every})


def _from_checkpoint(tmp_path, name, source):
    """A 1 x 2 job whose checkpoint directory starts with a copy of ``source``."""
    spec = _spec(tmp_path, name, 1, 2, 1)
    shutil.copytree(source, os.path.join(spec.checkpoint.dir, source.name))
    return spec


def test_resume_on_another_world_size_continues_the_same_sample_stream(tmp_path):
    old = _spec(tmp_path, "old_2x2", 2, 2, 2)
    run_job(old)
    source = tmp_path / "old_2x2" / "ckpt" / "step_00000002"
    old_ids = sample_ids.read(old.trainer.log_dir)

    straight = _from_checkpoint(tmp_path, "new_straight", source)
    straight_state, straight_log = run_job(straight)
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
