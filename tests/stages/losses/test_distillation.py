"""The distillation divergence: hand-derived values on a two-token vocabulary, then TRL 1.16's chunked kernel."""
from __future__ import annotations

import math

import pytest
import torch

from stages.losses import distillation_loss, generalized_jsd

# Student logits (0, 0): p_s = (1/2, 1/2). Teacher logits (ln 3, 0): p_t = (3/4, 1/4).
STUDENT = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
TEACHER = torch.tensor([[math.log(3), 0.0]], dtype=torch.float64)


def test_reverse_kl_by_hand():
    """β = 1: Σ p_s log(p_s / p_t) = ½ ln(½ / ¾) + ½ ln(½ / ¼) = ½ ln(4/3)."""
    assert generalized_jsd(STUDENT, TEACHER, beta=1.0).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)


def test_forward_kl_by_hand():
    """β = 0: Σ p_t log(p_t / p_s) = ¾ ln(3/2) + ¼ ln(1/2)."""
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert generalized_jsd(STUDENT, TEACHER, beta=0.0).item() == pytest.approx(expected, abs=1e-12)


def test_jsd_by_hand():
    """β = ½: m = (5/8, 3/8); ½ [¾ ln(¾ / ⅝) + ¼ ln(¼ / ⅜)] + ½ [½ ln(½ / ⅝) + ½ ln(½ / ⅜)]."""
    expected = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) \
        + 0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))
    assert generalized_jsd(STUDENT, TEACHER, beta=0.5).item() == pytest.approx(expected, abs=1e-12)


def test_temperature_divides_both_logits():
    """T = 2 on logits (0, 0) and (2 ln 3, 0) is T = 1 on (0, 0) and (ln 3, 0): the same ½ ln(4/3)."""
    got = generalized_jsd(STUDENT, TEACHER * 2, beta=1.0, temperature=2.0)
    assert got.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)


def test_equal_distributions_give_zero_and_the_loss_sums_over_the_step():
    """Identical rows: 0. Loss over 2 positions with num_items_in_batch 4: (½ ln(4/3) + 0) / 4."""
    student = torch.cat([STUDENT, TEACHER])
    loss, metrics = distillation_loss(student, torch.cat([TEACHER, TEACHER]), beta=1.0, num_items_in_batch=4)
    assert loss.item() == pytest.approx(0.5 * math.log(4 / 3) / 4, abs=1e-12)
    assert metrics["divergence"].item() == pytest.approx(0.5 * math.log(4 / 3) / 2, abs=1e-12)
    # entropies: ln 2 for (½, ½) and -(¾ ln ¾ + ¼ ln ¼) for (¾, ¼), averaged
    expected_entropy = (math.log(2) - (0.75 * math.log(0.75) + 0.25 * math.log(0.25))) / 2
    assert metrics["entropy"].item() == pytest.approx(expected_entropy, abs=1e-12)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"beta = 1.5: must be in \[0, 1\]"):
        generalized_jsd(STUDENT, TEACHER, beta=1.5)
    with pytest.raises(ValueError, match=r"teacher_logits has shape \(1, 3\)"):
        generalized_jsd(STUDENT, torch.zeros(1, 3), beta=1.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_same_batch_as_trls_chunked_divergence(beta):
    """TRL 1.16's `_chunked_divergence_loss` (hidden states x lm-head weights, its CPU tile path) against ours on the
    logits of the same hidden states and heads: equal loss and equal gradient to the student's hidden states."""
    pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    torch.manual_seed(0)
    B, C, H, V = 3, 4, 8, 11
    h_s = torch.randn(B, C, H, requires_grad=True)
    h_t = torch.randn(B, C, H)
    w_s, w_t = torch.randn(V, H), torch.randn(V, H)
    mask = (torch.arange(C)[None] < torch.tensor([4, 2, 3])[:, None]).long()
    theirs, _, n = _chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta, temperature=0.7)
    grad_theirs, = torch.autograd.grad(theirs, h_s)

    select = mask.bool()
    ours, _ = distillation_loss(h_s[select] @ w_s.T, h_t[select] @ w_t.T, beta=beta, temperature=0.7)
    grad_ours, = torch.autograd.grad(ours, h_s)
    assert int(n) == int(select.sum())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-4, atol=1e-6)
