"""Reward shaping (DAPO overlong penalty, KL in the reward) and the critic's value loss, by hand."""

from __future__ import annotations

import pytest
import torch

from distflow.algorithms import (
    AdaptiveKLController, FixedKLController, LossNormalizer, aggregate_loss, apply_kl_penalty,
    clipped_value_loss, overlong_penalty,
)
from distflow.spec import KLControlSpec
from distflow.stages import build_kl_controller

pytestmark = pytest.mark.unit


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    # L = 20, C = 8: no penalty up to 12 tokens, then -(|y| - 12) / 8, -1 at 20 and beyond
    lengths = torch.tensor([1, 12, 13, 16, 19, 20, 25])
    expected = torch.tensor([0.0, 0.0, -1 / 8, -4 / 8, -7 / 8, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 8), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 20, 8, penalty_factor=0.5), expected * 0.5)
    # a buffer as long as L penalises every token: 1 token of 4 -> -1/4
    torch.testing.assert_close(overlong_penalty(torch.tensor([1, 4]), 4, 4), torch.tensor([-0.25, -1.0]))


def test_overlong_buffer_outside_the_response_length_is_rejected():
    with pytest.raises(ValueError, match="overlongBuffer.length"):
        overlong_penalty(torch.tensor([3]), 8, 9)
    with pytest.raises(ValueError, match="overlongBuffer.length"):
        overlong_penalty(torch.tensor([3]), 8, 0)


def test_value_loss_gradient_flows_only_where_the_unclipped_error_is_taken():
    # c = 0.2 around old 1.0. v=1.5, R=2: clipped error (1.2-2)^2 wins, v outside the range -> grad 0.
    # v=1.1, R=2: inside the range, both terms equal -> grad (v - R) = -0.9.
    # v=0.5, R=2: unclipped (1.5^2) wins -> grad (v - R) = -1.5.
    # v=1.5, R=0: unclipped (2.25 > 1.44) wins -> grad 1.5.
    values = torch.tensor([[1.5, 1.1, 0.5, 1.5]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[2.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.ones_like(returns)
    vf_losses, clipfrac = clipped_value_loss(values, torch.ones_like(returns), returns, mask, 0.2)
    vf_losses.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9, -1.5, 1.5]], dtype=torch.float64))
    assert clipfrac.item() == pytest.approx(1 / 4)


def test_value_loss_token_mean_over_global_tokens_splits_exactly_over_micro_batches():
    values = torch.tensor([[0.5, 0.2, 9.0], [1.0, 3.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    norm = LossNormalizer(global_num_tokens=5, global_num_seqs=2, max_response_length=3)
    losses, _ = clipped_value_loss(values, values, returns, mask, 0.5)  # old = new: no clipping
    # 0.5 * (0.25 + 0.64 + 1 + 1 + 0) / 5
    whole = aggregate_loss(losses, mask, "token-mean", norm)
    assert whole.item() == pytest.approx(0.5 * 2.89 / 5)
    parts = sum(aggregate_loss(losses[i:i + 1], mask[i:i + 1], "token-mean", norm) for i in range(2))
    assert parts.item() == pytest.approx(whole.item())


def test_kl_controller_comes_from_the_spec():
    fixed = build_kl_controller(KLControlSpec(kl_coef=0.05))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = build_kl_controller(KLControlSpec(type="adaptive", kl_coef=0.1, target_kl=0.02, horizon=100))
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(current_kl=0.03, n_steps=10)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 10 / 100)
    assert adaptive.value == pytest.approx(0.1 * 1.02)


def test_kl_in_reward_with_an_adaptive_coefficient_over_two_steps():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    log_probs = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0], [-1.2, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=4)
    # k1 = logp - ref: (0.5, -1.0) and (0.2, masked); sequence means -0.25 and 0.2 -> batch KL -0.025
    rewards, kl = apply_kl_penalty(scores, log_probs, ref, mask, ctrl.value, "k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.1], [-0.02, 0.0]], dtype=torch.float64))
    assert kl.item() == pytest.approx(-0.025)
    ctrl.update(kl.item(), n_steps=2)  # error -1.25 clipped to -0.2: x (1 - 0.2 * 2 / 4) = x 0.9
    assert ctrl.value == pytest.approx(0.09)
    rewards, _ = apply_kl_penalty(scores, log_probs, ref, mask, ctrl.value, "k1")
    torch.testing.assert_close(rewards[0], torch.tensor([-0.045, 1.09], dtype=torch.float64))
