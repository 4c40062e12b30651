"""KL estimators, logits helpers, masked statistics and loss aggregation across simulated dp ranks."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    LossNormalizer,
    aggregate_loss,
    apply_kl_penalty,
    entropy_from_logits,
    get_kl_estimator,
    log_probs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)


def test_kl_estimators_on_known_values():
    # token 0: p = 1/2, ref = 1/4; token 1: p = 1/4, ref = 1/2
    log_probs = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    ref_log_probs = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    expected = {
        "k1": [LN2, -LN2],
        "abs": [LN2, LN2],
        "k2": [0.5 * LN2**2, 0.5 * LN2**2],  # 0.240227
        # k3 = e^x - x - 1 with x = ref - logp: x = -ln2 -> 0.5 + ln2 - 1 = 0.193147; x = ln2 -> 2 - ln2 - 1 = 0.306853
        "k3": [LN2 - 0.5, 1.0 - LN2],
        "low_var_kl": [LN2 - 0.5, 1.0 - LN2],
    }
    for name, values in expected.items():
        estimate = KL_ESTIMATORS[name](log_probs, ref_log_probs)
        torch.testing.assert_close(estimate, torch.tensor([values], dtype=torch.float64))


def test_k3_is_non_negative_zero_at_equality_and_clamped_at_ten():
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.randn(64, 32, generator=generator) * 3
    ref_log_probs = torch.randn(64, 32, generator=generator) * 3
    assert (KL_ESTIMATORS["k3"](log_probs, ref_log_probs) >= 0).all()
    assert torch.count_nonzero(KL_ESTIMATORS["k3"](log_probs, log_probs)) == 0
    assert KL_ESTIMATORS["k3"](torch.zeros(1, 1), torch.full((1, 1), 20.0)).item() == 10.0


def test_k1_and_k3_expectations_under_p_equal_exact_kl():
    generator = torch.Generator().manual_seed(1)
    log_p = torch.log_softmax(torch.randn(7, generator=generator, dtype=torch.float64), dim=0)
    log_ref = torch.log_softmax(torch.randn(7, generator=generator, dtype=torch.float64), dim=0)
    exact = (log_p.exp() * (log_p - log_ref)).sum()
    for name in ("k1", "k3"):
        estimate = (log_p.exp() * KL_ESTIMATORS[name](log_p, log_ref)).sum()
        torch.testing.assert_close(estimate, exact)


def test_apply_kl_penalty_subtracts_masked_kl_and_reports_sequence_mean():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    log_probs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -5.0]], dtype=torch.float64)
    ref_log_probs = torch.tensor([[-1.5, -0.5, -2.0], [-1.2, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    rewards, mean_kl = apply_kl_penalty(scores, log_probs, ref_log_probs, mask, kl_coef=0.1, estimator="k1")
    # k1 = logp - ref: row 0 (0.5, -0.5, 1.0), row 1 (0.2, 0, masked)
    expected = torch.tensor([[-0.05, 0.05, 0.9], [-0.02, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    # per-sequence means 1/3 and 0.1 -> 0.216667
    assert mean_kl.item() == pytest.approx((1 / 3 + 0.1) / 2)


def test_adaptive_kl_controller_moves_proportionally_with_clipped_error():
    controller = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 0.0256)
    assert controller.value == pytest.approx(0.2 * 1.00512)
    controller.update(current_kl=6.6, n_steps=256)  # error 0.1: x (1 + 0.1 * 0.0256)
    assert controller.value == pytest.approx(0.2 * 1.00512 * 1.00256)
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    restored.update(current_kl=3.0, n_steps=256)  # error -0.5 clipped to -0.2: x 0.99488
    assert restored.value == pytest.approx(0.2 * 1.00512 * 1.00256 * 0.99488)
    fixed = FixedKLController(kl_coef=0.05)
    fixed.update(current_kl=100.0, n_steps=256)
    assert fixed.value == 0.05


def test_unknown_kl_estimator_and_aggregation_mode_list_the_choices():
    with pytest.raises(ValueError, match="k1.*k2.*k3.*low_var_kl.*abs"):
        get_kl_estimator("k4")
    normalizer = LossNormalizer(global_num_tokens=1, global_num_seqs=1, max_response_length=1)
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum", normalizer)
    with pytest.raises(ValueError, match="global_num_tokens"):
        LossNormalizer(global_num_tokens=0, global_num_seqs=1, max_response_length=1)


def test_entropy_matches_direct_formula_and_uniform_is_log_vocab():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=generator, dtype=torch.float64) * 4
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(probs * probs.log()).sum(-1))
    uniform = entropy_from_logits(torch.full((2, 3, 50), 7.0, dtype=torch.bfloat16))
    assert uniform.dtype == torch.float32
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(50.0)))


def test_log_probs_from_logits_matches_log_softmax_gather_across_chunks():
    generator = torch.Generator().manual_seed(3)
    # 3 x 700 rows crosses the 1024-row chunk boundary
    logits = (torch.randn(3, 700, 13, generator=generator, dtype=torch.float64) * 5).requires_grad_(True)
    labels = torch.randint(0, 13, (3, 700), generator=generator)
    result = log_probs_from_logits(logits, labels)
    reference = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(result, reference)
    weights = torch.randn(3, 700, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((result * weights).sum(), logits)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(grad, reference_grad)
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(logits, labels[:, :5])


# Eight sequences of different lengths, padded to T = 7.
LENGTHS = [7, 1, 4, 6, 2, 5, 3, 7]
MAX_RESPONSE_LENGTH = 7
# Each layout: per dp rank, its micro-batches as lists of sequence indices.
LAYOUTS = {
    "1-rank": [[[0, 1, 2, 3, 4, 5, 6, 7]]],
    "1-rank-3-micro": [[[5], [0, 2, 7], [1, 3, 4, 6]]],
    "2-ranks": [[[0, 5], [2]], [[7, 1, 3, 4, 6]]],
    "4-ranks": [[[3], [0]], [[6, 1]], [[4], [2], [5]], [[7]]],
}


def reference_loss(loss_mat, mask, mode):
    """The global-batch loss computed at once, from the definitions."""
    token_sums = (loss_mat * mask).sum(-1)
    num_tokens = mask.sum(-1)
    return {
        "token-mean": token_sums.sum() / num_tokens.sum(),
        "seq-mean-token-sum": token_sums.mean(),
        "seq-mean-token-mean": (token_sums / num_tokens).mean(),
        "seq-mean-token-sum-norm": token_sums.sum() / (len(LENGTHS) * MAX_RESPONSE_LENGTH),
    }[mode]


def per_token_loss(leaf):
    """An elementwise, non-linear loss so gradients differ per token."""
    return leaf**2 * 0.5 - 3.0 * leaf


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_on_all_ranks_sum_to_the_global_loss_and_gradient(mode, layout):
    generator = torch.Generator().manual_seed(4)
    mask = (torch.arange(MAX_RESPONSE_LENGTH) < torch.tensor(LENGTHS).unsqueeze(-1)).to(torch.float64)
    # padding holds large junk that must not leak into the loss
    leaf = torch.randn(8, MAX_RESPONSE_LENGTH, generator=generator, dtype=torch.float64) + 100 * (1 - mask)
    leaf.requires_grad_(True)
    expected = reference_loss(per_token_loss(leaf), mask, mode)
    (expected_grad,) = torch.autograd.grad(expected, leaf)

    normalizer = LossNormalizer(
        global_num_tokens=float(mask.sum()), global_num_seqs=len(LENGTHS), max_response_length=MAX_RESPONSE_LENGTH
    )
    total = torch.zeros((), dtype=torch.float64)
    for rank_micro_batches in LAYOUTS[layout]:
        for rows in rank_micro_batches:
            # a micro-batch is trimmed to its own longest response, as dynamic batching does
            width = max(LENGTHS[i] for i in rows)
            loss = aggregate_loss(per_token_loss(leaf[rows, :width]), mask[rows, :width], mode, normalizer)
            loss.backward()  # gradient accumulation into leaf.grad
            total = total + loss.detach()
    torch.testing.assert_close(total, expected.detach())
    torch.testing.assert_close(leaf.grad, expected_grad)


def test_masked_mean_and_var_ignore_masked_values():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    # 1 2 3 4: mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    assert masked_mean(values, mask).item() == pytest.approx(2.5)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 3.5], dtype=torch.float64))
    assert masked_var(values, mask).item() == pytest.approx(5 / 3)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(values, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_masked_whiten_with_reducer_over_ranks_equals_whitening_the_concatenation():
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(6, 5, generator=generator, dtype=torch.float64) * 3 + 2
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 1, 3, 5]).unsqueeze(-1)).to(torch.float64)
    picked = values[mask.bool()]
    expected = (values - picked.mean()) / torch.sqrt(picked.var() + 1e-8)
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False), expected + picked.mean())

    rank_rows = [[0, 4], [1, 2, 3], [5]]
    partials = []
    for rows in rank_rows:
        masked_whiten(values[rows], mask[rows], reducer=lambda t: partials.append(t) or t)
    assert len(partials) == len(rank_rows)  # one reducer call per rank
    total = torch.stack(partials).sum(dim=0)
    for rows in rank_rows:
        whitened = masked_whiten(values[rows], mask[rows], reducer=lambda t: total)
        torch.testing.assert_close(whitened * mask[rows], expected[rows] * mask[rows])
