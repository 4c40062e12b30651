"""The blockwise log-prob/entropy function equals the plain float32 path, values and gradients,
and keeps no float32 copy of the logits for backward."""

import pytest
import torch

from distflow.algorithms import logits as logits_mod
from distflow.algorithms import log_probs_and_entropy

pytestmark = pytest.mark.unit


def _plain(logits, labels, temperature):
    """The path before blockwise fusion: whole-tensor float32 upcast, tempered, log_softmax, softmax."""
    z = logits.float() if logits.dtype != torch.float64 else logits
    z = z / temperature if temperature not in (0, 1) else z
    log_p = torch.log_softmax(z, dim=-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(3, 700, 13), (40, 5, 13)])  # blocks of one row's positions / of several rows
def test_values_and_gradients_equal_the_plain_path(temperature, shape):
    generator = torch.Generator().manual_seed(4)
    full = (torch.randn(shape[0], shape[1] + 1, shape[2], generator=generator, dtype=torch.float64) * 4)
    full.requires_grad_(True)
    view = full[:, :-1]  # a non-contiguous view, as the model's logits minus the last position
    labels = torch.randint(0, shape[2], shape[:2], generator=generator)
    w_lp, w_ent = (torch.randn(shape[:2], generator=generator, dtype=torch.float64) for _ in range(2))
    lp, ent = log_probs_and_entropy(view, labels, temperature, entropy_grad=True)
    ref_lp, ref_ent = _plain(view, labels, temperature)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), full)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), full)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_bf16_logits_match_the_float32_path_and_entropy_is_constant_unless_asked():
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 9, 50, generator=generator) * 3).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 50, (2, 9), generator=generator)
    lp, ent = log_probs_and_entropy(logits, labels)
    assert lp.dtype == ent.dtype == torch.float32 and lp.requires_grad and not ent.requires_grad
    ref_lp, ref_ent = _plain(logits, labels, 1.0)
    # float32 rounding: lse - E[x] against -sum p log p differ in the last digits
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, ref_grad)  # bf16 tolerance: the gradient is stored in the logits' dtype


def test_backward_keeps_only_the_logits_and_per_position_floats():
    logits = torch.randn(2, 30, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 64, (2, 30))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        log_probs_and_entropy(logits, labels, 0.5)
    vocab_sized = [t for t in saved if t.shape[-1:] == (64,)]
    assert len(vocab_sized) == 1 and vocab_sized[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t is not vocab_sized[0]) == 3 * 2 * 30  # labels, lse, entropy


def test_blocks_cover_every_position_once(monkeypatch):
    monkeypatch.setattr(logits_mod, "_ROWS_PER_CHUNK", 8)
    for shape in [(3, 20), (5, 3), (1, 8), (2, 0)]:
        seen = torch.zeros(shape, dtype=torch.int64)
        for rows, cols in logits_mod._blocks(torch.Size(shape)):
            seen[rows, cols] += 1
        assert bool((seen == 1).all()), shape
