"""PPO, DAPO and custom nodes through the local launcher with a tiny model on gloo.

- PPO (critic, GAE whitened across ranks, KL in the reward with an adaptive
  coefficient): centralized and distributed data planes give identical actor
  and critic parameters and metrics;
- PPO resumed after a crash continues exactly (critic, its optimizer and the
  KL coefficient are checkpointed);
- DAPO: dynamic sampling refills and regroups the batch, identically on both
  data planes, and its statistics reach metrics.jsonl;
- a custom node's output is what the following nodes see.
"""

from __future__ import annotations

import os

import pytest
import torch
from _jobs import initial_params, run_job, tiny_job_spec
from distflow.launcher import launch_local

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800), pytest.mark.usefixtures("device_guard")]


def _spec(tmp_path, name, workflow, reward="distinct_chars", **over):
    return tiny_job_spec(tmp_path, name, reward, workflow=workflow, **over)


def _ppo(tmp_path, name, **over):
    kl = {"useKlInReward": True, "klCtrl": {"type": "adaptive", "klCoef": 0.05, "targetKl": 0.001, "horizon": 8}}
    return _spec(tmp_path, name, {"name": "ppo"}, algorithm=kl, **over)


def _run(spec):
    return run_job(spec)


def _assert_same(a: dict, b: dict, keys=("model", "critic")) -> None:
    for part in keys:
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), f"{part}.{name}"


def test_ppo_centralized_and_distributed_give_identical_actor_and_critic(tmp_path):
    dist_ckpt, dist_log = _run(_ppo(tmp_path, "distributed"))
    cent_ckpt, cent_log = _run(_ppo(tmp_path, "centralized", dataPlane={"mode": "centralized"}))
    _assert_same(dist_ckpt, cent_ckpt)
    initial = initial_params()
    assert any(not torch.equal(initial[k], v) for k, v in dist_ckpt["model"].items()), "the actor did not train"
    for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "actor/reward_kl_penalty",
                "critic/score/mean", "actor/pg_loss"):
        assert [r[key] for r in dist_log] == [r[key] for r in cent_log], key
    # The critic trained (its head starts at 0) and the adaptive coefficient moved off its start.
    assert dist_log[0]["critic/values/mean"] == 0.0 and dist_log[1]["critic/values/mean"] != 0.0
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in dist_log]
    assert coeffs[0] == 0.05 and coeffs[1] != 0.05
    assert sum(r["data/busiest_rank_bytes"] for r in cent_log) > sum(r["data/busiest_rank_bytes"] for r in dist_log)


@pytest.mark.long  # the default run: the chaos trials (GRPO) and a resume that fills actor and critic
# from the checkpoint alone (tests/dist/test_resume_from_checkpoint_alone.py)
def test_ppo_resumed_after_a_crash_matches_the_uninterrupted_run(tmp_path):
    steps, ckpt = {"totalSteps": 3}, {"saveEverySteps": 2}
    full, full_log = _run(_ppo(tmp_path, "full", trainer=steps, checkpoint=ckpt))
    crashed = _ppo(tmp_path, "crashed", trainer=steps, checkpoint=ckpt)
    os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"] = "3"
    try:
        with pytest.raises(Exception, match="injected failure at step 3"):
            launch_local(crashed, "job", progress=False)
    finally:
        del os.environ["DISTFLOW_INJECT_FAILURE_AT_STEP"]
    resumed, resumed_log = _run(crashed)
    _assert_same(full, resumed)  # the critic's last step also needs its restored optimizer state
    for key in ("critic/vf_loss", "actor/reward_kl_penalty_coeff"):
        assert resumed_log[-1][key] == full_log[-1][key], key


def _dapo(tmp_path, name, **over):
    return _spec(tmp_path, name, {"name": "dapo"}, reward="odd_length",
                 trainer={"totalSteps": 3}, **over)


def test_dapo_dynamic_sampling_is_identical_on_both_data_planes_and_logged(tmp_path):
    dist_ckpt, dist_log = _run(_dapo(tmp_path, "distributed"))
    cent_ckpt, cent_log = _run(_dapo(tmp_path, "centralized", dataPlane={"mode": "centralized"}))
    _assert_same(dist_ckpt, cent_ckpt, keys=("model",))
    batch = 4
    for record in dist_log:
        rounds, kept = record["dapo/num_gen_batches"], record["dapo/kept_groups"]
        # every round generates trainBatchSize groups; the kept ones fill the batch, dropped ones pad it
        assert kept + record["dapo/dropped_groups"] == rounds * batch
        assert record["dapo/padded_groups"] == max(0, batch - kept)
        assert rounds == 4 or kept >= batch
    assert any(r["dapo/num_gen_batches"] > 1 for r in dist_log), "no step needed a refill round"
    assert any(r.get("data/bytes_sent/dynamic_sampling/regroup", 0) > 0 for r in dist_log), "no group moved"
    for key in ("dapo/kept_groups", "dapo/dropped_groups", "actor/pg_loss", "reward/overlong_penalty/mean"):
        assert [r[key] for r in dist_log] == [r[key] for r in cent_log], key


def test_custom_node_output_is_what_the_next_nodes_see(tmp_path):
    nodes = [{"id": "gen", "role": "rollout", "kind": "inference"},
             {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
             {"id": "silence", "role": "custom", "kind": "compute", "deps": ["score"],
              "function": "toy_nodes:zero_scores"},
             {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["silence"]},
             {"id": "train", "role": "actor", "kind": "train", "deps": ["adv"]}]
    spec = _spec(tmp_path, "custom", {"nodes": nodes}, algorithm={"useKlLoss": False},
                 cluster={"numNodes": 1}, trainer={"totalSteps": 1})
    ckpt, log = _run(spec)
    # The reward node scored the responses, but the advantage saw the custom node's zeros: no update at all.
    assert log[0]["critic/score/mean"] > 0 and log[0]["critic/advantages/mean"] == 0.0
    assert log[0]["actor/grad_norm"] == 0.0
    initial = initial_params()
    assert all(torch.equal(initial[k], v) for k, v in ckpt["model"].items())
