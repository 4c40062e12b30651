"""Advantage estimators against hand-computed values and loop/closed-form references."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algorithms import ADVANTAGES, AdvantageInputs, AdvantageParams, get_advantage_fn

pytestmark = pytest.mark.unit


def outcome_inputs(scores, lengths, groups, num_tokens=4, values=None):
    """A batch whose reward is each score on its last response token."""
    rewards = torch.zeros(len(scores), num_tokens, dtype=torch.float64)
    mask = torch.zeros(len(scores), num_tokens, dtype=torch.float64)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, length - 1] = score
        mask[i, :length] = 1.0
    return AdvantageInputs(rewards, mask, torch.tensor(groups, dtype=torch.int64), values)


def per_sequence(advantages, inputs):
    """[B] the advantage of each sequence, after checking it is constant on its tokens and 0 elsewhere."""
    first = advantages[:, 0]
    expected = first.unsqueeze(-1) * inputs.response_mask
    torch.testing.assert_close(advantages, expected)
    return first


def run_on_simulated_ranks(fn, shards):
    """fn(shard, reducer) on each simulated dp rank, with a reducer that sums over ranks.

    Two passes: the first records each rank's partial sums, the second hands
    every rank their total. Valid because each estimator calls the reducer once.
    """
    partials = []
    for shard in shards:
        fn(shard, lambda t: partials.append(t.clone()) or t)
    assert len(partials) == len(shards)
    total = torch.stack(partials).sum(dim=0)
    return [fn(shard, lambda t: total) for shard in shards]


# Three groups, interleaved in the batch: g0 scores (1, 0, 0), g1 (2, 4), g2 (5) alone.
SCORES = [1.0, 2.0, 0.0, 5.0, 4.0, 0.0]
GROUPS = [0, 1, 0, 2, 1, 0]
LENGTHS = [4, 2, 3, 1, 4, 2]


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    inputs = outcome_inputs(SCORES, LENGTHS, GROUPS)
    eps = 1e-6
    # g0: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 1/sqrt(3)
    # g1: mean 3, var (1 + 1) / 1 = 2, std sqrt(2); g2 alone: mean 0, std 1
    std0, std1 = 1 / math.sqrt(3), math.sqrt(2)
    expected = [
        (2 / 3) / (std0 + eps),
        -1 / (std1 + eps),
        (-1 / 3) / (std0 + eps),
        5 / (1 + eps),
        1 / (std1 + eps),
        (-1 / 3) / (std0 + eps),
    ]
    advantages, returns = get_advantage_fn("grpo")(inputs, AdvantageParams(epsilon=eps), None)
    torch.testing.assert_close(per_sequence(advantages, inputs), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(returns, advantages)
    # 2/3 * sqrt(3) = 1.1547, 1/sqrt(2) = 0.7071
    assert advantages[0, 0].item() == pytest.approx(1.154700, abs=1e-5)
    assert advantages[4, 3].item() == pytest.approx(0.707106, abs=1e-5)


def test_grpo_group_of_one_keeps_its_raw_score():
    inputs = outcome_inputs([3.0], [2], [7])
    advantages, _ = ADVANTAGES["grpo"](inputs, AdvantageParams(epsilon=1e-6), None)
    # mean 0, std 1: 3 / (1 + 1e-6)
    torch.testing.assert_close(advantages, torch.tensor([[3 / (1 + 1e-6)] * 2 + [0.0, 0.0]], dtype=torch.float64))


def test_grpo_without_std_division_only_subtracts_group_mean():
    inputs = outcome_inputs(SCORES, LENGTHS, GROUPS)
    # g0: (1, 0, 0) - 1/3; g1: (2, 4) - 3; g2: 5 - 0
    expected = torch.tensor([2 / 3, -1.0, -1 / 3, 5.0, 1.0, -1 / 3], dtype=torch.float64)
    advantages, _ = ADVANTAGES["grpo"](inputs, AdvantageParams(norm_adv_by_std=False), None)
    torch.testing.assert_close(per_sequence(advantages, inputs), expected)


def test_drgrpo_never_divides_by_std():
    inputs = outcome_inputs(SCORES, LENGTHS, GROUPS)
    expected = torch.tensor([2 / 3, -1.0, -1 / 3, 5.0, 1.0, -1 / 3], dtype=torch.float64)
    advantages, returns = ADVANTAGES["drgrpo"](inputs, AdvantageParams(norm_adv_by_std=True), None)
    torch.testing.assert_close(per_sequence(advantages, inputs), expected)
    torch.testing.assert_close(returns, advantages)


def test_grpo_identical_scores_give_zero_advantage():
    inputs = outcome_inputs([1.0, 1.0, 1.0], [2, 3, 1], [0, 0, 0])
    advantages, _ = ADVANTAGES["grpo"](inputs, AdvantageParams(), None)
    assert torch.count_nonzero(advantages) == 0


def test_rloo_subtracts_the_mean_of_the_other_samples():
    inputs = outcome_inputs(SCORES, LENGTHS, GROUPS)
    # g0: 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -0.5 (twice); g1: 2 - 4 = -2, 4 - 2 = 2; g2 alone: 5
    expected = torch.tensor([1.0, -2.0, -0.5, 5.0, 2.0, -0.5], dtype=torch.float64)
    advantages, returns = ADVANTAGES["rloo"](inputs, AdvantageParams(), None)
    torch.testing.assert_close(per_sequence(advantages, inputs), expected)
    torch.testing.assert_close(returns, advantages)


def test_reinforce_plus_plus_discounts_then_whitens_over_tokens():
    # gamma 0.5; seq 0 (3 tokens) rewards (0, 0, 1) -> returns (0.25, 0.5, 1);
    # seq 1 (2 tokens + pad) rewards (0, 2, 0) -> returns (1, 2, 0).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    inputs = AdvantageInputs(rewards, mask, torch.tensor([0, 1]))
    advantages, returns = ADVANTAGES["reinforce_plus_plus"](inputs, AdvantageParams(gamma=0.5), None)
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], dtype=torch.float64))
    # tokens 0.25 0.5 1 1 2: mean 0.95, deviations -0.7 -0.45 0.05 0.05 1.05,
    # squares sum 1.8, unbiased var 1.8/4 = 0.45, std 0.670820
    std = math.sqrt(0.45 + 1e-8)
    expected = torch.tensor([[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]], dtype=torch.float64) / std
    torch.testing.assert_close(advantages, expected)
    assert advantages[1, 1].item() == pytest.approx(1.565248, abs=1e-6)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    # scores (1, 0 | 3), groups (0, 0 | 1): centered 0.5, -0.5, 3 (singleton keeps its score)
    inputs = outcome_inputs([1.0, 0.0, 3.0], [2, 1, 2], [0, 0, 1], num_tokens=2)
    advantages, returns = ADVANTAGES["reinforce_plus_plus_baseline"](inputs, AdvantageParams(), None)
    # tokens 0.5 0.5 -0.5 3 3: mean 1.3, deviations -0.8 -0.8 -1.8 1.7 1.7,
    # squares sum 10.3, unbiased var 2.575, std 1.604681
    std = math.sqrt(2.575 + 1e-8)
    expected = torch.tensor([[-0.8, -0.8], [-1.8, 0.0], [1.7, 1.7]], dtype=torch.float64) / std
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, advantages)


def test_gae_hand_computed_with_padding_bootstrapping_from_zero():
    # gamma 0.9, lam 0.5, one response of 2 tokens and a pad whose value (99) must be ignored.
    # delta_1 = 1 + 0.9 * 0 - 0.2 = 0.8;            A_1 = 0.8
    # delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32;        A_0 = -0.32 + 0.45 * 0.8 = 0.04
    # returns = A + V = (0.54, 1.0, 0); whitened A over 2 tokens = -+1/sqrt(2)
    rewards = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 99.0]], dtype=torch.float64)
    inputs = AdvantageInputs(rewards, mask, torch.tensor([0]), values)
    advantages, returns = ADVANTAGES["gae"](inputs, AdvantageParams(gamma=0.9, lam=0.5), None)
    torch.testing.assert_close(returns, torch.tensor([[0.54, 1.0, 0.0]], dtype=torch.float64))
    half = 0.38 / math.sqrt(2 * 0.38**2 + 1e-8)
    torch.testing.assert_close(advantages, torch.tensor([[-half, half, 0.0]], dtype=torch.float64))


def random_gae_batch(seed, lengths, num_tokens):
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    mask = (torch.arange(num_tokens) < torch.tensor(lengths).unsqueeze(-1)).to(torch.float64)
    rewards = torch.randn(batch, num_tokens, generator=generator, dtype=torch.float64) * mask
    values = torch.randn(batch, num_tokens, generator=generator, dtype=torch.float64)
    return AdvantageInputs(rewards, mask, torch.arange(batch), values)


def closed_form_gae(inputs, gamma, lam):
    """A_t = sum_k (gamma lam)^(k-t) delta_k as one matrix product per batch (no recursion)."""
    mask = inputs.response_mask
    values = inputs.values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = (inputs.token_level_rewards + gamma * next_values - values) * mask
    steps = torch.arange(mask.shape[1], dtype=torch.float64)
    offsets = steps.unsqueeze(0) - steps.unsqueeze(1)  # [t, k] = k - t
    discount = torch.where(offsets >= 0, (gamma * lam) ** offsets.clamp_min(0), torch.zeros(()))
    return deltas @ discount.T, values


def reference_whiten(values, mask):
    picked = values[mask.bool()]
    return (values - picked.mean()) / torch.sqrt(picked.var() + 1e-8) * mask


def test_gae_recursion_matches_closed_form_sum():
    inputs = random_gae_batch(0, lengths=[7, 1, 4, 6, 3], num_tokens=7)
    raw_advantages, values = closed_form_gae(inputs, gamma=0.99, lam=0.95)
    advantages, returns = ADVANTAGES["gae"](inputs, AdvantageParams(gamma=0.99, lam=0.95), None)
    torch.testing.assert_close(returns, raw_advantages + values)
    torch.testing.assert_close(advantages, reference_whiten(raw_advantages, inputs.response_mask))


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_global_whitening_over_ranks_equals_whole_batch(name):
    whole = random_gae_batch(1, lengths=[5, 2, 6, 1, 3, 6], num_tokens=6)
    params = AdvantageParams(gamma=0.9, lam=0.8)
    expected, _ = ADVANTAGES[name](whole, params, None)
    rank_rows = [[0, 3], [1, 2, 5], [4]]
    fields = ("token_level_rewards", "response_mask", "group_index", "values")
    shards = [AdvantageInputs(*(getattr(whole, field)[rows] for field in fields)) for rows in rank_rows]
    results = run_on_simulated_ranks(lambda shard, reducer: ADVANTAGES[name](shard, params, reducer), shards)
    for rows, (advantages, _) in zip(rank_rows, results, strict=True):
        torch.testing.assert_close(advantages, expected[rows])


def test_gae_without_values_is_a_value_error():
    inputs = outcome_inputs([1.0], [2], [0])
    with pytest.raises(ValueError, match="values"):
        ADVANTAGES["gae"](inputs, AdvantageParams(), None)


def test_unknown_estimator_lists_the_choices():
    with pytest.raises(ValueError, match="grpo.*rloo.*gae"):
        get_advantage_fn("ppo_magic")


def test_inputs_with_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="response_mask"):
        AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="group_index"):
        AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="gamma"):
        AdvantageParams(gamma=1.5)
