"""Multi-turn GRPO steps through the local launcher, tiny model, 2 gloo workers.

The distributed and the centralized data planes train on the same
multi-turn samples (model turns, then environment observations with mask 0,
and so on) and reach bit-identical parameters, as the single-turn parity test
(tests/dist/test_grpo_end_to_end.py) holds for one turn; and one worker alone
samples the same trajectories. (Parameters of a 1-worker run are not compared:
AdamW amplifies the float rounding of differently sharded gradients; that the
loss does not depend on the split is test_loss_rank_invariance's, with SGD.)
Each worker runs as many turns as its own samples need: nothing waits on the
other rank between turns.
"""

from pathlib import Path

import pytest
import torch
from _jobs import initial_params, merged, run_job, tiny_job_spec

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900), pytest.mark.usefixtures("device_guard")]

ENVS = Path(__file__).with_name("toy_envs.py")
MULTI_TURN = {"data": {"shuffle": True, "maxResponseLength": 40},
              "rollout": {"n": 2, "temperature": 1.0, "multiTurn": {
                  "enable": True, "environment": f"{ENVS}:Echo", "maxTurns": 3, "maxTokensPerTurn": 4}},
              "algorithm": {"useKlLoss": False}}


def _run(tmp_path, name, **over):
    checkpoint, log = run_job(tiny_job_spec(tmp_path, name, **merged(MULTI_TURN, over)), name)
    return checkpoint["model"], log


def test_distributed_and_centralized_runs_train_identical_multi_turn_steps(tmp_path):
    dist_params, dist_log = _run(tmp_path, "distributed")
    cent_params, cent_log = _run(tmp_path, "centralized", dataPlane={"mode": "centralized"})
    assert dist_params.keys() == cent_params.keys()
    for k in dist_params:
        assert torch.equal(dist_params[k], cent_params[k]), k
    initial = initial_params()
    assert any(not torch.equal(initial[k], v) for k, v in dist_params.items()), "training changed nothing"
    for step in dist_log:  # really multi-turn: several model turns, environment steps, appended tokens
        assert step["multiturn/num_turns/mean"] > 1.5 and step["multiturn/num_turns/max"] == 3
        assert step["multiturn/tool_calls"] > 0 and sum(step[f"multiturn/tool_errors/{k}"] for k in
                                                       ("exception", "timeout", "bad_output", "parse")) == 0
        # response_length counts the model's own tokens (at most 3 turns of 4); the observations
        # appended between turns make every sample longer than its prompt and those tokens.
        assert step["response_length/max"] <= 3 * 4
        samples = 4 * 2  # trainBatchSize x rollout.n
        assert step["perf/total_num_tokens"] > samples * (step["prompt_length/mean"] + step["response_length/mean"])
    assert [r["critic/score/mean"] for r in dist_log] == [r["critic/score/mean"] for r in cent_log]
    assert [r["multiturn/num_turns/mean"] for r in dist_log] == [r["multiturn/num_turns/mean"] for r in cent_log]

    # One worker samples the same first-step trajectories (turns, lengths, environment rewards):
    # each depends on its own seeds, not on the rank that rolled it out or on which samples share it.
    _, one_log = _run(tmp_path, "single", cluster={"numNodes": 1})
    for key in ("multiturn/num_turns/mean", "response_length/mean", "multiturn/env_reward/mean", "critic/score/mean"):
        assert one_log[0][key] == pytest.approx(dist_log[0][key], rel=1e-9), key
