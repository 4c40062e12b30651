"""The actor and critic updates take the same step however a batch is split over ranks and micro-batches.

Real FSDP2 on gloo, the real ``Actor.update`` / ``Critic.update``, the tiny
model: 8 samples of different prompt and response lengths run on 1, 2 or 4
ranks with several micro-batch sizes, for every loss aggregation mode (and
GSPO). The optimizer is swapped for plain SGD and clipping is off, so the
parameter change of each step is exactly -lr x the aggregated gradient; two
PPO epochs make the first step off-policy (ratios from ``old_log_probs``,
clipping and dual clip active) and the second start from the first's result.
Every layout must reproduce the 1-rank, one-micro-batch reference.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

PROMPT_LENS = [3, 9, 5, 4, 7, 3, 6, 8]
RESPONSE_LENS = [7, 1, 4, 6, 2, 5, 3, 7]
LAYOUTS = {1: [[0, 1, 2, 3, 4, 5, 6, 7]], 2: [[0, 5, 2, 7], [1, 3, 4, 6]], 4: [[3, 0], [6, 1], [4, 2], [5, 7]]}
MICRO_BATCH_SIZES = {1: (8, 3), 2: (3, 1), 4: (2, 1)}
"""1 rank: every config with both (8 is the reference); 2 and 4 ranks: configs alternate between the two."""
ACTOR_CONFIGS = [("vanilla", mode) for mode in
                 ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")]
ACTOR_CONFIGS.append(("gspo", "seq-mean-token-mean"))
CRITIC_MODES = ["token-mean", "seq-mean-token-sum"]
LR = 0.05
TOKEN_RANGE = (100, 400)  # ids used by the batch; their embedding rows are compared in full


def _batch():
    """8 samples: random tokens, advantages, returns, and noise that turns current log-probs/values into old ones."""
    from distflow.data.batch import PackedBatch

    gen = torch.Generator().manual_seed(11)
    lens = torch.tensor([p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)])
    total = int(lens.sum())
    mask = torch.cat([torch.tensor([0] * p + [1] * r, dtype=torch.int8) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)])

    def on_response(scale):
        return torch.randn(total, generator=gen) * scale * mask

    return PackedBatch(lens, {
        "input_ids": torch.randint(*TOKEN_RANGE, (total,), generator=gen),
        "response_mask": mask,
        "advantages": on_response(1.0),
        "returns": on_response(1.0),
        "old_noise": on_response(0.3),   # |noise| > 0.2 on about half the tokens: clipped ratios
        "ref_noise": on_response(0.3),
        "value_noise": on_response(0.1),  # cliprange 0.05: clipped values
    }, {"prompt_len": torch.tensor(PROMPT_LENS), "response_len": torch.tensor(RESPONSE_LENS)})


def _spec(micro: int, actor=None, critic=None):
    from distflow.spec import parse_spec

    policy_loss, mode = actor or ("vanilla", "token-mean")
    return parse_spec({
        "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4,
                                            "maxResponseLength": 8},
        "algorithm": {"policyLoss": policy_loss, "lossAggMode": mode, "useKlLoss": True, "klLossCoef": 0.5,
                      "entropyCoeff": 0.01, "clipRatioHigh": 0.28},
        "actor": {"microBatchSize": micro, "ppoEpochs": 2, "gradClip": 1e9},
        "critic": {"microBatchSize": micro, "ppoEpochs": 2, "gradClip": 1e9, "cliprangeValue": 0.05,
                   "lossAggMode": critic or "token-mean"},
    })


def _compared(model) -> dict[str, torch.Tensor]:
    """Full parameters; of the (large, tied) embedding only the batch's rows and every 512th row."""
    from distflow.engines import fsdp

    out = {}
    for name, full in fsdp.full_state_tensors(model):
        if full.dim() == 2 and full.shape[0] > 10_000:
            rows = torch.cat([torch.arange(*TOKEN_RANGE), torch.arange(0, full.shape[0], 512)])
            full = full[rows]
        out[name] = full.detach().clone()
    return out


def _step(model, update, batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from distflow.metrics import StepMetrics

    before = _compared(model)
    metrics = StepMetrics()
    update(batch, metrics)
    after = _compared(model)
    return {k: after[k] - before[k] for k in before}, metrics.reduce(torch.device("cpu"))


def _fsdp_actor(world, spec, replicate=1):
    """The tiny model sharded over ``world`` ranks, as an ``Actor`` whose optimizer is SGD(LR);
    ``replicate`` > 1: over HSDP's 2-D mesh (``fsdp.dp_mesh``)."""
    from distflow.engines import fsdp
    from distflow.engines.actor import Actor
    from distflow.models import load_causal_lm, model_cache_dir, resolve_model

    model = fsdp.apply_fsdp(load_causal_lm(resolve_model("tiny", model_cache_dir())),
                            fsdp.dp_mesh(torch.device("cpu"), world, replicate))
    actor = Actor.build(spec, model, 0, world, torch.device("cpu"))
    actor.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return actor


def _fsdp_critic(world, spec):
    """The tiny model's backbone with a non-zero head (so the backbone gets gradients from the
    first step), sharded over ``world`` ranks, as a ``Critic`` whose optimizer is SGD(LR)."""
    from distflow.engines import fsdp
    from distflow.engines.critic import Critic, load_value_model
    from distflow.models import model_cache_dir, resolve_model

    value_model = load_value_model(str(resolve_model("tiny", model_cache_dir())))
    torch.nn.init.normal_(value_model.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(5))
    model = fsdp.apply_fsdp(value_model, fsdp.dp_mesh(torch.device("cpu"), world))
    critic = Critic.build(spec, model, 0, world, torch.device("cpu"))
    critic.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return critic


def _actor_update(world, local, micro, config, replicate=1):
    from distflow.engines import model_ops

    actor = _fsdp_actor(world, _spec(micro, actor=config), replicate)
    log_probs = model_ops.compute_log_probs(actor.model, local, 0, 8, 1.0)
    local = local.with_fields(token={"old_log_probs": log_probs + local.token_fields["old_noise"],
                                     "ref_log_probs": log_probs + local.token_fields["ref_noise"]})
    return _step(actor.model, actor.update, local)


def _critic_update(world, local, micro, mode):
    critic = _fsdp_critic(world, _spec(micro, critic=mode))
    values = critic.compute_values(local)
    local = local.with_fields(token={"values": values + local.token_fields["value_noise"]})
    return _step(critic.model, critic.update, local)


def _all_updates(rank, world):
    torch.set_num_threads(1)
    local = _batch().select(LAYOUTS[world][rank])
    configs = [("actor", c) for c in ACTOR_CONFIGS] + [("critic", m) for m in CRITIC_MODES]
    out = {}
    for i, (role, config) in enumerate(configs):
        sizes = MICRO_BATCH_SIZES[world]
        for micro in sizes if world == 1 else sizes[i % 2:i % 2 + 1]:
            update = _actor_update if role == "actor" else _critic_update
            out[(role, config, micro)] = update(world, local, micro, config)
    # Parameters are the same full tensors on every rank; rank 0's are enough.
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def updates():
    from distflow.models import resolve_model
    from distflow.models import model_cache_dir

    resolve_model("tiny", model_cache_dir())  # build once, before the ranks race for it
    return {world: run_on_ranks(_all_updates, world, timeout_s=1500)[0] for world in LAYOUTS}


LOSS_METRICS = {"actor": ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"],
                "critic": ["critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm"]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_layout_and_micro_batch_size_takes_the_one_rank_step(updates, world):
    for (role, config, micro), (delta, metrics) in updates[world].items():
        ref_delta, ref_metrics = updates[1][(role, config, 8)]
        _assert_same_step(role, (delta, metrics), (ref_delta, ref_metrics),
                          f"{role} {config} on {world} ranks, micro-batch {micro}")


def _assert_same_step(role: str, step, reference, where: str) -> None:
    """``step`` = (parameter deltas, metrics) equals ``reference``'s up to float32 summation order."""
    (delta, metrics), (ref_delta, ref_metrics) = step, reference
    for name, expected in ref_delta.items():
        # float32 sums in another order differ in the last bits; a wrong normaliser is off by >= 1/8
        scale = float(expected.abs().max())
        torch.testing.assert_close(delta[name], expected, rtol=1e-3, atol=1e-4 * scale,
                                   msg=lambda m: f"{where}, {name}: {m}")
    for key in LOSS_METRICS[role]:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-7), f"{where}: {key}"


def test_the_reference_step_is_not_trivial(updates):
    for (role, config, _), (delta, metrics) in updates[1].items():
        assert all(d.abs().max() > 0 for d in delta.values()), (role, config)
    actor = updates[1][("actor", ("vanilla", "token-mean"), 8)][1]
    assert 0 < actor["actor/pg_clipfrac"] < 1 and actor["actor/kl_loss"] > 0
    critic = updates[1][("critic", "token-mean", 8)][1]
    assert 0 < critic["critic/vf_clipfrac"] < 1
