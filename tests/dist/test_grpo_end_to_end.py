"""Full GRPO steps through the local launcher with a tiny model on gloo.

- centralized and distributed data planes give identical parameters;
- a run killed mid-way and resumed gives the same parameters as an
  uninterrupted run;
(that the loss and gradients do not depend on how samples are split over
ranks is tests/dist/test_loss_rank_invariance.py).
"""

import os

import pytest
import torch
from _jobs import initial_params, merged, run_job, tiny_job_spec
from distflow.checkpoint import complete_checkpoints
from distflow.launcher import launch_local

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600), pytest.mark.usefixtures("device_guard")]

GRPO = {"data": {"shuffle": True}, "algorithm": {"useKlLoss": True, "klLossCoef": 0.01}}


def _spec(tmp_path, name, **over):
    return tiny_job_spec(tmp_path, name, **merged(GRPO, over))


def _run(spec, name="job", **kw):
    checkpoint, log = run_job(spec, name, **kw)
    return checkpoint["model"], log


@pytest.mark.parametrize("share", [True, False], ids=["prompt-groups", "single-samples"])
def test_centralized_and_distributed_give_identical_parameters(tmp_path, share):
    """With shared prompt prefixes the balancer moves whole groups; without, single samples.

    The centralized run with shared prefixes also keeps the actor's weights gathered from the
    rollout through the update (``actor.reshardAfterForward: false``): the same parameters,
    fewer all-gathered bytes (both counted by the runtime).
    """
    actor = {"sharePromptPrefix": share}
    dist_params, dist_log = _run(_spec(tmp_path, "distributed", actor=actor))
    held = {**actor, "reshardAfterForward": not share}
    cent_params, cent_log = _run(_spec(tmp_path, "centralized", dataPlane={"mode": "centralized"}, actor=held))
    assert dist_params.keys() == cent_params.keys()
    for k in dist_params:
        assert torch.equal(dist_params[k], cent_params[k]), k
    initial = initial_params()
    assert any(not torch.equal(initial[k], v) for k, v in dist_params.items()), "training changed nothing"
    # The balanced edge really moved samples, and rank 0 carried everything when centralized.
    assert sum(r["data/busiest_rank_bytes"] for r in dist_log) > 0
    assert sum(r["data/busiest_rank_bytes"] for r in cent_log) > sum(r["data/busiest_rank_bytes"] for r in dist_log)
    assert [r["critic/score/mean"] for r in dist_log] == [r["critic/score/mean"] for r in cent_log]
    # FSDP2's collectives, counted: every step gathers weights and reduces gradients; the held
    # layout skips the update's gathers (the reference model's remain).
    for dist_step, cent_step in zip(dist_log, cent_log):
        assert dist_step["perf/reduce_scatter_bytes"] == cent_step["perf/reduce_scatter_bytes"] > 0
        if share:
            assert 0 < cent_step["perf/allgather_bytes"] < dist_step["perf/allgather_bytes"]
        else:
            assert dist_step["perf/allgather_bytes"] == cent_step["perf/allgather_bytes"] > 0


@pytest.mark.long  # the default run's chaos trials (tests/dist/test_chaos.py) assert the same, and more
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    steps = {"totalSteps": 4}
    ckpt = {"saveEverySteps": 2}
    full, full_log = _run(_spec(tmp_path, "full", trainer=steps, checkpoint=ckpt))
    crashed = _spec(tmp_path, "crashed", trainer=steps, checkpoint=ckpt)
    os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"] = "4"  # dies after logging step 3, checkpoint at 2
    try:
        with pytest.raises(Exception, match="injected failure at step 4"):
            launch_local(crashed, "job", progress=False)
    finally:
        del os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"]
    assert [p.name for p in complete_checkpoints(crashed.checkpoint.dir)] == ["step_00000002"]
    resumed, resumed_log = _run(crashed)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # Steps 3 and 4 after resume saw the same samples and rewards as the uninterrupted run.
    assert [r["critic/score/mean"] for r in resumed_log[-2:]] == [r["critic/score/mean"] for r in full_log[-2:]]
    assert [r["training/step"] for r in resumed_log] == [1, 2, 3, 4]  # each step logged once


@pytest.mark.timeout(300)
def test_an_error_on_one_rank_fails_the_job_instead_of_hanging(tmp_path):
    spec = _spec(tmp_path, "fails", reward="fails_on_rank_1", checkpoint={"dir": None})
    with pytest.raises(Exception, match="reward failed on rank 1"):
        launch_local(spec, "job", progress=False)
