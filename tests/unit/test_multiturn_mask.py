"""Multi-turn responses: ``response_mask`` is 0 on tool tokens between the model's turns.

Every algorithm and engine must treat those tokens as absent: the outcome sits on the model's
last token, GAE and discounted returns run over the model's tokens only, and token counts,
losses and metrics ignore whatever the tool tokens hold. The invariance tests build the same
samples twice, once with a tool segment filled with garbage log-probs, advantages and values,
once with the segment cut out, and require the same loss, gradients and metrics.

The layout used throughout (P prompt, M model, T tool; the mask below the tokens)::

    ends with a model turn     P P | M M T T M M     0 0 1 1 0 0 1 1   prompt_len 2, response_len 6
    cut inside a tool output   P P | M M M T T       0 0 1 1 1 0 0     prompt_len 2, response_len 5
    single turn                P P | M M             0 0 1 1           prompt_len 2, response_len 2
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from distflow.algorithms import AdvantageInputs, AdvantageParams, LossNormalizer, aggregate_loss, masked_whiten
from distflow.algorithms.advantages import gae_advantages, grpo_advantages, reinforce_plus_plus_advantages
from distflow.data.batch import PackedBatch
from distflow.data.model_tokens import last_model_column, last_model_token, model_token_counts
from distflow.engines import model_ops
from distflow.engines.actor import Actor
from distflow.engines.critic import Critic
from distflow.metrics import StepMetrics
from distflow.spec import parse_spec
from distflow.stages.scoring import run_reward_shaping, score_fields

pytestmark = pytest.mark.unit

VOCAB = 11
MASKS = ([0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1])
GARBAGE = 1e30  # finite in float32; exp() of it, or its square, is inf


def _batch(masks, seed: int = 0, garbage: float = GARBAGE, drop_tool_tokens: bool = False) -> PackedBatch:
    """Samples of the given masks (prompt = the leading 0s), random ids and per-token fields.

    Tool tokens (0s after the first 1) hold ``garbage`` in every float field; with
    ``drop_tool_tokens`` they are cut out, which leaves each sample single-turn.
    """
    gen = torch.Generator().manual_seed(seed)
    masks = [torch.tensor(m, dtype=torch.int8) for m in masks]
    prompt_lens = [int(m.argmax()) for m in masks]  # the first 1
    ids = [torch.randint(3, VOCAB, (len(m),), generator=gen) for m in masks]

    def floats(scale: float, offset: float = 0.0):
        return [torch.randn(len(m), generator=gen) * scale + offset for m in masks]

    fields = {"old_log_probs": floats(0.3, -1.5), "ref_log_probs": floats(0.3, -1.5),
              "rollout_log_probs": floats(0.3, -1.5), "advantages": floats(1.0),
              "values": floats(1.0), "returns": floats(1.0)}
    keep = [torch.ones(len(m), dtype=torch.bool) for m in masks]
    for i, (m, p) in enumerate(zip(masks, prompt_lens)):
        tool = (m == 0) & (torch.arange(len(m)) >= p)
        keep[i] = ~tool
        for values in fields.values():
            values[i] = torch.where(tool, garbage, values[i])
            values[i][:p] = 0.0
    if drop_tool_tokens:
        masks, ids = [m[k] for m, k in zip(masks, keep)], [t[k] for t, k in zip(ids, keep)]
        fields = {name: [v[k] for v, k in zip(values, keep)] for name, values in fields.items()}
    lens = torch.tensor([len(m) for m in masks])
    return PackedBatch(lens, {"input_ids": torch.cat(ids), "response_mask": torch.cat(masks),
                              **{name: torch.cat(values) for name, values in fields.items()}},
                       {"prompt_len": torch.tensor(prompt_lens), "response_len": lens - torch.tensor(prompt_lens),
                        "group_index": torch.zeros(len(masks), dtype=torch.long)})


def test_the_outcome_sits_on_the_last_model_token_even_when_a_tool_output_ends_the_sample():
    batch = _batch(MASKS)
    # Packed offsets 0, 8, 15. Last 1s: 0 + 7, 8 + 4 (the tool tokens 13, 14 follow), 15 + 3.
    assert last_model_token(batch).tolist() == [7, 12, 18]
    out = score_fields(batch, [1.0, 0.5, -1.0])
    expected = torch.zeros(batch.num_tokens)
    expected[[7, 12, 18]] = torch.tensor([1.0, 0.5, -1.0])
    torch.testing.assert_close(out.token["token_level_scores"], expected, rtol=0, atol=0)
    assert model_token_counts(batch).tolist() == [4, 3, 2]


def test_a_response_without_model_tokens_keeps_its_outcome_on_its_last_token():
    batch = _batch([[0, 0, 0]])
    assert last_model_token(batch).tolist() == [2]
    assert last_model_column(torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])).tolist() == [2, 4]


def test_overlong_penalty_counts_the_models_tokens_and_sits_with_the_outcome():
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "maxResponseLength": 6},
                       "algorithm": {"useKlLoss": False,
                                     "overlongBuffer": {"enable": True, "length": 4, "penaltyFactor": 1.0}}})
    batch = _batch(MASKS)
    batch = batch.with_fields(token=score_fields(batch, [1.0, 0.5, -1.0]).token)
    ctx = SimpleNamespace(spec=spec, tokenizer=SimpleNamespace(pad_token_id=0), metrics=StepMetrics())
    rewards = run_reward_shaping(ctx, None, batch).token["token_level_rewards"]
    # L = 6, C = 4: penalty -(|y| - 2) / 4 over the model's tokens |y| = 4, 3, 2 -> -0.5, -0.25, 0
    # (response_len 6, 5, 2 would give -1, -0.75, 0), each on the sample's last model token.
    expected = torch.zeros(batch.num_tokens)
    expected[[7, 12, 18]] = torch.tensor([1.0 - 0.5, 0.5 - 0.25, -1.0])
    torch.testing.assert_close(rewards, expected)


# One sample, response window M M T T M M: model-token rewards 0, 0, 0, 1 and values 0.5, 0.6,
# 0.7, 0.8; the tool tokens carry a reward of 5 and values 9, -9 that must be ignored.
_WINDOW_MASK = torch.tensor([[1, 1, 0, 0, 1, 1]])
_WINDOW_REWARDS = torch.tensor([[0.0, 0.0, 5.0, 5.0, 0.0, 1.0]], dtype=torch.float64)
_WINDOW_VALUES = torch.tensor([[0.5, 0.6, 9.0, -9.0, 0.7, 0.8]], dtype=torch.float64)
_MODEL_COLUMNS = [0, 1, 4, 5]


def test_gae_skips_the_tool_segment_hand_computed():
    params = AdvantageParams(gamma=0.9, lam=0.8)
    # gamma * lam = 0.72; the model tokens are a chain 0 -> 1 -> 4 -> 5, the tool columns skipped:
    # t=5: delta = 1 + 0.9 * 0   - 0.8 = 0.2                    A5 = 0.2
    # t=4: delta = 0 + 0.9 * 0.8 - 0.7 = 0.02                   A4 = 0.02 + 0.72 * 0.2     = 0.164
    # t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03 (V of column 4)   A1 = 0.03 + 0.72 * 0.164   = 0.14808
    # t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72 * 0.14808 = 0.1466176
    # returns = A + V: 0.6466176, 0.74808, 0.864, 1.0
    inputs = AdvantageInputs(_WINDOW_REWARDS, _WINDOW_MASK, torch.zeros(1, dtype=torch.long), _WINDOW_VALUES)
    advantages, returns = gae_advantages(inputs, params)
    raw = torch.tensor([[0.1466176, 0.14808, 0.164, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(returns[:, _MODEL_COLUMNS],
                               torch.tensor([[0.6466176, 0.74808, 0.864, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(advantages[:, _MODEL_COLUMNS], masked_whiten(raw, torch.ones_like(raw)))
    assert advantages[0, 2:4].tolist() == [0.0, 0.0]
    # Cut the tool segment out: a single-turn response with the same advantages and returns.
    cut = AdvantageInputs(_WINDOW_REWARDS[:, _MODEL_COLUMNS], torch.ones(1, 4, dtype=torch.long),
                          torch.zeros(1, dtype=torch.long), _WINDOW_VALUES[:, _MODEL_COLUMNS])
    cut_advantages, cut_returns = gae_advantages(cut, params)
    torch.testing.assert_close(advantages[:, _MODEL_COLUMNS], cut_advantages)
    torch.testing.assert_close(returns[:, _MODEL_COLUMNS], cut_returns)


def test_discounted_returns_run_over_the_model_tokens_only():
    inputs = AdvantageInputs(_WINDOW_REWARDS, _WINDOW_MASK, torch.zeros(1, dtype=torch.long))
    _, returns = reinforce_plus_plus_advantages(inputs, AdvantageParams(gamma=0.5))
    # G5 = 1, G4 = 0.5, then (tool columns skipped, their reward 5 ignored) G1 = 0.25, G0 = 0.125.
    assert returns[0, _MODEL_COLUMNS].tolist() == [0.125, 0.25, 0.5, 1.0]


def test_outcome_advantages_are_zero_on_tool_tokens():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0]])  # the second cut inside a tool output
    advantages, _ = grpo_advantages(AdvantageInputs(rewards, mask, torch.zeros(2, dtype=torch.long)),
                                    AdvantageParams())
    # scores 1, 0: mean 0.5, std sqrt(0.5); A = +-0.5 / (0.70710678 + 1e-6) on the model's tokens only.
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(advantages, torch.tensor([[a, a, 0, 0, a, a], [0, -a, -a, -a, 0, 0]]))


def test_aggregation_counts_and_sums_the_model_tokens_only():
    loss = torch.tensor([[1.0, 2.0, float("inf"), float("nan"), 3.0, 4.0], [0.0, 5.0, 7.0, 9.0, -GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0]])
    norm = LossNormalizer(global_num_tokens=float(mask.sum()), global_num_seqs=2.0, max_response_length=10)
    # model tokens: 1 + 2 + 3 + 4 = 10 over 4, and 5 + 7 + 9 = 21 over 3; 7 tokens in all.
    assert aggregate_loss(loss, mask, "token-mean", norm).item() == pytest.approx(31 / 7)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", norm).item() == pytest.approx(31 / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", norm).item() == pytest.approx((10 / 4 + 21 / 3) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm).item() == pytest.approx(31 / 20)


def _spec(**algorithm) -> object:
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 3},
                       "rollout": {"engine": "vllm", "tisImpRatioCap": 2.0},
                       "actor": {"lr": 1e-3}, "critic": {"lr": 1.0},
                       "algorithm": {"entropyCoeff": 0.01, **algorithm}})


def test_the_actor_counts_the_model_tokens():
    actor = Actor.build(_spec(), _UnigramLM(), pad_token_id=0, dp_size=1, device=torch.device("cpu"))
    assert actor._global_counts(_batch(MASKS)).global_num_tokens == 4 + 3 + 2


class _UnigramLM(torch.nn.Module):
    """Logits that ignore the context, so cutting tokens out leaves the others' log-probs alone."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids, logits_to_keep: int = 0, **_):
        keep = logits_to_keep or input_ids.shape[1]
        return SimpleNamespace(logits=self.logits + torch.zeros(input_ids.shape[0], keep, VOCAB))


class _ConstantValue(torch.nn.Module):
    """One learned value for every position (context-free, as ``_UnigramLM``)."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(0.25))

    def forward(self, input_ids, attention_mask, position_ids, num_positions: int):
        return self.value.expand(input_ids.shape[0], num_positions).clone()


def _actor_loss(spec, batch: PackedBatch, on_policy: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    actor = Actor.build(spec, _UnigramLM(), pad_token_id=0, dp_size=1, device=torch.device("cpu"))
    loss, stats, _ = actor._micro_loss(model_ops.collate(batch, 0), actor._global_counts(batch), on_policy)
    loss.backward()
    return loss.detach(), actor.model.logits.grad, {k: float(v) for k, v in stats.items()}


@pytest.mark.parametrize("algorithm, on_policy", [
    ({"lossAggMode": "token-mean", "useKlLoss": True, "klLossType": "k2"}, True),  # GRPO
    ({"lossAggMode": "seq-mean-token-sum-norm", "useKlLoss": True, "klLossType": "low_var_kl"}, True),  # Dr. GRPO
    ({"lossAggMode": "token-mean", "useKlLoss": False}, False),  # PPO: ratios against old_log_probs
    ({"lossAggMode": "seq-mean-token-mean", "useKlLoss": False, "policyLoss": "gspo"}, False),
])
def test_actor_loss_ignores_tool_tokens_whatever_they_hold(algorithm, on_policy):
    spec = _spec(**algorithm)
    loss, grad, stats = _actor_loss(spec, _batch(MASKS), on_policy)
    cut_loss, cut_grad, cut_stats = _actor_loss(spec, _batch(MASKS, drop_tool_tokens=True), on_policy)
    assert torch.isfinite(loss) and loss != 0
    torch.testing.assert_close(loss, cut_loss)
    torch.testing.assert_close(grad, cut_grad)
    assert stats == pytest.approx(cut_stats)


def test_critic_update_ignores_tool_tokens_whatever_they_hold():
    def update(batch: PackedBatch) -> tuple[float, dict]:
        critic = Critic.build(_spec(), _ConstantValue(), pad_token_id=0, dp_size=1, device=torch.device("cpu"))
        critic.optimizer = torch.optim.SGD(critic.model.parameters(), lr=0.1)  # the step is the gradient
        metrics = StepMetrics()
        critic.update(batch, metrics)
        return critic.model.value.item(), metrics.reduce(torch.device("cpu"))

    value, metrics = update(_batch(MASKS, garbage=1e6))
    cut_value, cut_metrics = update(_batch(MASKS, drop_tool_tokens=True))
    assert value != 0.25 and value == pytest.approx(cut_value, rel=1e-6)
    assert metrics["critic/vf_loss"] == pytest.approx(cut_metrics["critic/vf_loss"], rel=1e-6)
    assert metrics["critic/vf_explained_var"] == pytest.approx(cut_metrics["critic/vf_explained_var"], rel=1e-6)


def test_an_environments_rewards_are_added_to_the_reward_functions_score():
    """Arithmetic's reward gives 1 for the right last integer, 0 for a wrong one; the
    environment's summed rewards (``env_reward``) come on top, per sample."""
    from distflow.data.records import PromptRecord
    from distflow.models import build_byte_tokenizer
    from distflow.stages.scoring import score_responses

    tokenizer = build_byte_tokenizer()
    texts = ["so 7", "so 8"]
    ids = [tokenizer.encode("Q?", add_special_tokens=False) + tokenizer.encode(t, add_special_tokens=False)
           for t in texts]
    prompt = len(tokenizer.encode("Q?", add_special_tokens=False))
    masks = [[0] * prompt + [1] * (len(i) - prompt) for i in ids]
    lens = torch.tensor([len(i) for i in ids])
    sample = {"prompt_len": torch.tensor([prompt, prompt]), "response_len": lens - prompt,
              "group_index": torch.tensor([0, 0])}
    token = {"input_ids": torch.tensor([t for i in ids for t in i]),
             "response_mask": torch.tensor([m for mm in masks for m in mm], dtype=torch.int8)}
    record = {0: PromptRecord("q0", ({"role": "user", "content": "3 + 4?"},), "7", "arithmetic")}
    _, _, plain = score_responses(tokenizer, PackedBatch(lens, token, sample), record, None, "")
    assert plain == [1.0, 0.0]
    with_env = PackedBatch(lens, token, {**sample, "env_reward": torch.tensor([0.5, -0.25])})
    _, _, scores = score_responses(tokenizer, with_env, record, None, "")
    assert scores == pytest.approx([1.5, -0.25])


def test_the_reward_reads_the_trajectory_up_to_the_models_last_turn():
    """Tool outputs between turns are part of the text; one cut off after the last turn is not
    (the model never answered from it): 'calc' + tool '17' + '=17' reads whole, 'calc' + tool
    '17' (budget spent) reads 'calc'."""
    from distflow.engines.rollout import response_texts
    from distflow.models import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    pieces = [[("Q", 0), ("calc", 1), ("17", 0), ("=17", 1)], [("Q", 0), ("calc", 1), ("17", 0)]]
    ids = [[t for text, _ in sample for t in enc(text)] for sample in pieces]
    masks = [[m for text, m in sample for _ in enc(text)] for sample in pieces]
    lens = torch.tensor([len(i) for i in ids])
    batch = PackedBatch(lens, {"input_ids": torch.tensor([t for i in ids for t in i]),
                               "response_mask": torch.tensor([m for mm in masks for m in mm], dtype=torch.int8)},
                        {"prompt_len": torch.tensor([1, 1]), "response_len": lens - 1})
    assert response_texts(tokenizer, batch) == ["calc17=17", "calc"]
