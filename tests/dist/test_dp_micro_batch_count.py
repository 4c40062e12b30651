"""Ranks that cut different numbers of micro-batches still finish a step, and take the one-rank step.

FSDP2 runs collectives in every forward and backward, so every dp rank must
run as many as the others. Two gloo ranks get samples skewed two ways: a
token budget of 20 cuts rank 0's lengths [8, 8, 9, 9] into 2 micro-batches
and rank 1's [10, 6, 14, 5] into 3; a micro-batch size of 2 cuts rank 0's six
samples into 3 and rank 1's two into 1, once more with the actor's weights
held gathered through the update (``reshardAfterForward: false``). Both ranks
must run the log-prob pass, the actor update and (sample_count) the critic
update to the end, with the parameters and losses of one rank holding all
eight samples in one micro-batch. Where each rank runs its own count, the
ranks fail in a collective or wait on each other until the timeout.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import run_on_ranks
from test_loss_rank_invariance import _assert_same_step, _fsdp_actor, _fsdp_critic, _step

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

PROMPT_LENS = [5, 4, 6, 3, 6, 2, 7, 3]
RESPONSE_LENS = [3, 4, 3, 6, 4, 4, 7, 2]  # lengths 8 8 9 9 10 6 14 5
SKEWS = {"token_budget": ({"microBatchSize": 8, "maxTokensPerMicroBatch": 20}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
         "sample_count": ({"microBatchSize": 2}, [[0, 1, 2, 3, 4, 5], [6, 7]]),
         "held_weights": ({"microBatchSize": 2, "reshardAfterForward": False}, [[0, 1, 2, 3, 4, 5], [6, 7]])}
REFERENCE = ({"microBatchSize": 8}, [[0, 1, 2, 3, 4, 5, 6, 7]])


def _batch():
    from distflow.data.batch import PackedBatch

    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)])
    total = int(lens.sum())
    mask = torch.cat([torch.tensor([0] * p + [1] * r, dtype=torch.int8) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)])
    noise = lambda scale: torch.randn(total, generator=gen) * scale * mask  # noqa: E731
    return PackedBatch(lens, {"input_ids": torch.randint(100, 400, (total,), generator=gen), "response_mask": mask,
                              "advantages": noise(1.0), "returns": noise(1.0), "old_noise": noise(0.3),
                              "ref_noise": noise(0.3), "value_noise": noise(0.1)},
                       {"prompt_len": torch.tensor(PROMPT_LENS), "response_len": torch.tensor(RESPONSE_LENS)})


def _spec(micro: dict):
    from distflow.spec import parse_spec

    return parse_spec({
        "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4,
                                            "maxResponseLength": 8},
        "algorithm": {"useKlLoss": True, "klLossCoef": 0.5, "entropyCoeff": 0.01},
        "actor": {**micro, "ppoEpochs": 2, "gradClip": 1e9},
        "critic": {"microBatchSize": micro["microBatchSize"], "ppoEpochs": 2, "gradClip": 1e9,
                   "cliprangeValue": 0.05},
    })


def _actor(world, local, spec):
    from distflow.engines import model_ops

    actor, a = _fsdp_actor(world, spec), spec.actor
    log_probs = model_ops.compute_log_probs(actor.model, local, 0, a.micro_batch_size, 1.0,
                                            max_tokens=a.max_tokens_per_micro_batch)
    local = local.with_fields(token={"old_log_probs": log_probs + local.token_fields["old_noise"],
                                     "ref_log_probs": log_probs + local.token_fields["ref_noise"]})
    return log_probs, _step(actor.model, actor.update, local)


def _critic(world, local, spec):
    critic = _fsdp_critic(world, spec)
    values = critic.compute_values(local)
    local = local.with_fields(token={"values": values + local.token_fields["value_noise"]})
    return values, _step(critic.model, critic.update, local)


def _skewed_step(rank, world, micro, layout, with_critic):
    torch.set_num_threads(1)
    local, spec = _batch().select(layout[rank]), _spec(micro)
    out = {"actor": _actor(world, local, spec)}
    if with_critic:
        out["critic"] = _critic(world, local, spec)
    return out


@pytest.fixture(scope="module")
def steps():
    from distflow.models import model_cache_dir, resolve_model

    resolve_model("tiny", model_cache_dir())  # build once, before the ranks race for it
    micro, layout = REFERENCE
    out = {"reference": run_on_ranks(_skewed_step, 1, micro, layout, True, timeout_s=400)[0]}
    for name, (micro, layout) in SKEWS.items():
        # A hang is the failure this guards against: fail after a bounded wait, not at the watchdog.
        out[name] = run_on_ranks(_skewed_step, 2, micro, layout, name == "sample_count", timeout_s=300)
    return out


@pytest.mark.parametrize("skew", list(SKEWS))
def test_skewed_ranks_finish_the_step_of_one_rank(steps, skew):
    _, layout = SKEWS[skew]
    ref = steps["reference"]
    for role, (ref_out, (ref_delta, ref_metrics)) in ref.items():
        if role not in steps[skew][0]:
            continue
        # Log-probs / values of each rank's samples equal the one-rank pass's for the same samples.
        ref_rows = _batch().with_fields(token={"out": ref_out})
        for rank, rank_steps in enumerate(steps[skew]):
            expected = ref_rows.select(layout[rank]).token_fields["out"]
            torch.testing.assert_close(rank_steps[role][0], expected, rtol=1e-4, atol=1e-5)
        # Parameters are the same full tensors on every rank; rank 0's are enough.
        _assert_same_step(role, steps[skew][0][role][1], (ref_delta, ref_metrics), f"{skew} {role}")
