"""Policy and value losses against hand-computed values and sequence-level references."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algorithms import (
    POLICY_LOSSES,
    LossNormalizer,
    PolicyLossParams,
    aggregate_loss,
    clipped_value_loss,
    explained_variance,
    get_policy_loss_fn,
    masked_mean,
)

pytestmark = pytest.mark.unit


def ratios_as_log_probs(ratios):
    """(old_log_probs = 0, log_probs = log ratio as a leaf), so the ratio is exactly ``ratios``."""
    log_probs = torch.tensor(ratios, dtype=torch.float64).log().requires_grad_(True)
    return torch.zeros_like(log_probs), log_probs


# Row 0: A = +1, ratios 1.25, 1.3, 0.5 and a pad (ratio e^3) that must not count.
# Row 1: A = -1, ratios 0.75, 0.85, 5.0, 2.0.
RATIOS = [[1.25, 1.3, 0.5, math.exp(3.0)], [0.75, 0.85, 5.0, 2.0]]
ADVANTAGES = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def test_vanilla_clip_higher_bounds_are_asymmetric_and_dual_clip_caps_negative_advantages():
    old_log_probs, log_probs = ratios_as_log_probs(RATIOS)
    params = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    out = POLICY_LOSSES["vanilla"](old_log_probs, log_probs, ADVANTAGES, MASK, params)
    # A=+1: max(-r, -clip(r, 0.8, 1.28)): 1.25 -> -1.25 (inside), 1.3 -> -1.28 (clipped),
    #       0.5 -> -0.5 (the unclipped term is the larger loss)
    # A=-1: max(r, clip(r)): 0.75 -> 0.8 (clipped), 0.85 -> 0.85, 5 -> 5 then dual clip min(5, 3) = 3, 2 -> 2
    expected = torch.tensor([[-1.25, -1.28, -0.5], [0.8, 0.85, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(out.pg_losses[:, :3], expected)
    assert out.pg_losses[1, 3].item() == pytest.approx(2.0)
    # clipped: (0,1) and (1,0) of 7 response tokens; dual clip: (1,2) only
    assert out.clipfrac.item() == pytest.approx(2 / 7)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 7)
    # approx_kl = mean of -log r over the 7 response tokens
    log_ratios = [math.log(r) for r in RATIOS[0][:3] + RATIOS[1]]
    assert out.approx_kl.item() == pytest.approx(-sum(log_ratios) / 7)
    # gradient w.r.t. log r is -A r where the unclipped term is taken, 0 where clipped
    (out.pg_losses * MASK).sum().backward()
    expected_grad = torch.tensor([[-1.25, 0.0, -0.5, 0.0], [0.0, 0.85, 0.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(log_probs.grad, expected_grad)


def test_symmetric_default_clips_what_clip_higher_lets_through():
    old_log_probs, log_probs = ratios_as_log_probs([[1.25]])
    out = POLICY_LOSSES["vanilla"](old_log_probs, log_probs, torch.ones(1, 1), torch.ones(1, 1), PolicyLossParams())
    assert out.pg_losses.item() == pytest.approx(-1.2)
    assert out.clipfrac.item() == 1.0


def test_dual_clip_activates_exactly_above_clip_ratio_c_for_negative_advantages_only():
    ratios = [[2.9, 3.1, 10.0], [2.9, 3.1, 10.0]]
    advantages = torch.tensor([[-2.0] * 3, [2.0] * 3], dtype=torch.float64)
    old_log_probs, log_probs = ratios_as_log_probs(ratios)
    out = POLICY_LOSSES["vanilla"](old_log_probs, log_probs, advantages, torch.ones(2, 3), PolicyLossParams())
    # A=-2: 2 * 2.9 = 5.8 stays; 2 * 3.1 and 2 * 10 are capped at 2 * 3 = 6
    # A=+2: every ratio above 1.2 is clipped by PPO: -2 * 1.2 = -2.4
    expected = torch.tensor([[5.8, 6.0, 6.0], [-2.4, -2.4, -2.4]], dtype=torch.float64)
    torch.testing.assert_close(out.pg_losses, expected)
    assert out.clipfrac_lower.item() == pytest.approx(2 / 6)


def gspo_batch():
    """Four sequences whose token log-ratios average to c_i (plus zero-mean noise), float64."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 6, 2])
    mask = (torch.arange(6) < lengths.unsqueeze(-1)).to(torch.float64)
    noise = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.3 * mask
    noise = noise - (noise.sum(-1, keepdim=True) / lengths.unsqueeze(-1)) * mask
    seq_log_ratio = torch.tensor([1e-4, 0.1, -0.1, -0.1], dtype=torch.float64)
    old_log_probs = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    log_probs = (old_log_probs + seq_log_ratio.unsqueeze(-1) + noise).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=torch.float64).unsqueeze(-1).expand(4, 6)
    return old_log_probs, log_probs, advantages, mask, seq_log_ratio


def sequence_level_gspo_loss(old_log_probs, log_probs, advantages, mask, params):
    """GSPO's objective as written in the paper: mean_i max(-A s_i, -A clip(s_i)), no stop-gradient."""
    ratio = torch.exp(masked_mean(log_probs - old_log_probs, mask, dim=-1))
    clipped = ratio.clamp(1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    advantage = advantages[:, 0]
    return torch.maximum(-advantage * ratio, -advantage * clipped).mean()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.9, 10.0)], ids=["paper-ranges", "nothing-clipped"])
def test_gspo_token_ratio_is_sequence_ratio_and_gradient_matches_sequence_objective(clip):
    old_log_probs, log_probs, advantages, mask, seq_log_ratio = gspo_batch()
    params = PolicyLossParams(clip_ratio_low=clip[0], clip_ratio_high=clip[1])
    out = get_policy_loss_fn("gspo")(old_log_probs, log_probs, advantages, mask, params)
    seq_ratio = seq_log_ratio.exp()
    if clip == (0.9, 10.0):
        # unclipped: every token's loss is -A_i * exp(mean_t log-ratio)
        torch.testing.assert_close(out.pg_losses * mask, -advantages * seq_ratio.unsqueeze(-1) * mask)
        assert out.clipfrac.item() == 0.0
    else:
        # s = e^1e-4 inside [1-3e-4, 1+4e-4]; s = e^0.1 with A>0 clipped to 1.0004;
        # s = e^-0.1 with A>0: unclipped -0.905 is the larger loss; with A<0 clipped to 0.9997
        expected = torch.tensor([-math.exp(1e-4), -1.0004, -math.exp(-0.1), 1 - 3e-4], dtype=torch.float64)
        torch.testing.assert_close(out.pg_losses[:, 0], expected)
        assert out.clipfrac.item() == pytest.approx((3 + 2) / 16)
    assert out.clipfrac_lower.item() == 0.0
    normalizer = LossNormalizer(global_num_tokens=16, global_num_seqs=4, max_response_length=6)
    aggregate_loss(out.pg_losses, mask, "seq-mean-token-mean", normalizer).backward()
    token_grad = log_probs.grad.clone()
    log_probs.grad = None
    sequence_level_gspo_loss(old_log_probs, log_probs, advantages, mask, params).backward()
    torch.testing.assert_close(token_grad, log_probs.grad)
    assert token_grad.abs().sum() > 0


def test_unknown_policy_loss_lists_the_choices():
    with pytest.raises(ValueError, match="vanilla.*gspo"):
        get_policy_loss_fn("clip_cov")


def test_policy_loss_params_reject_dual_clip_at_or_below_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossParams(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        PolicyLossParams(clip_ratio_low=1.0)


def test_clipped_value_loss_takes_the_larger_error_halved():
    # c = 0.2 around old value 1.0, so clipped predictions lie in [0.8, 1.2]
    # v=1.5, R=2:  clip 1.2 -> (0.8)^2 = 0.64 > (0.5)^2 = 0.25 -> 0.32, clipped
    # v=1.1, R=2:  inside the range -> 0.81 -> 0.405
    # v=0.5, R=0:  clip 0.8 -> 0.64 > 0.25 -> 0.32, clipped
    # v=0.5, R=2:  clip 0.8 -> 1.44 < 2.25 -> 1.125
    values = torch.tensor([[1.5, 1.1, 0.5, 0.5, 7.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    vf_losses, vf_clipfrac = clipped_value_loss(values, torch.ones_like(values), returns, mask, 0.2)
    torch.testing.assert_close(vf_losses[:, :4], torch.tensor([[0.32, 0.405, 0.32, 1.125]], dtype=torch.float64))
    assert vf_clipfrac.item() == pytest.approx(2 / 4)


def test_explained_variance_hand_value_and_across_ranks():
    # residual (0.5, 0, 0, -0.5): unbiased var 0.5/3; returns 1..4: var 5/3 -> 1 - 0.1 = 0.9
    values = torch.tensor([[0.5, 2.0, 9.0], [3.0, 4.5, 9.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.9)
    partials = [
        torch.tensor([2.0, 0.5, 0.25, 3.0, 5.0], dtype=torch.float64),  # rank 0: row 0
        torch.tensor([2.0, -0.5, 0.25, 7.0, 25.0], dtype=torch.float64),  # rank 1: row 1
    ]
    total = partials[0] + partials[1]
    # each rank's local sums are what it hands the reducer; the reducer returns the total
    for rank in range(2):
        rows = slice(rank, rank + 1)
        seen = []
        local = explained_variance(
            values[rows], returns[rows], mask[rows], lambda t, seen=seen: seen.append(t) or total
        )
        torch.testing.assert_close(seen, [partials[rank]])
        assert local.item() == pytest.approx(0.9)
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask).item())
