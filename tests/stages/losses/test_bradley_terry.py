"""reward_loss: Bradley–Terry with margin and centering, checked against hand-derived numbers.

Throughout: r_c = [2, 0, 1], r_r = [0, 0, 3], so d = r_c - r_r = [2, 0, -2] and
-log σ(x) = log(1 + e^(-x)).
"""
import math

import pytest
import torch

from stages.losses import reward_loss

RC, RR = [2.0, 0.0, 1.0], [0.0, 0.0, 3.0]


def _t(values, **kw):
    return torch.tensor(values, dtype=torch.float64, **kw)


def test_bradley_terry_value_and_metrics():
    """loss = (log(1+e^-2) + log 2 + log(1+e^2)) / 3 = (2 + 2·log(1+e^-2) + log 2) / 3 ≈ 0.98233,
    since log(1+e^2) = 2 + log(1+e^-2). accuracy: only d = 2 > 0 (the tie d = 0 is wrong) -> 1/3;
    margin = mean(d) = 0; rewards {2, 0, 1, 0, 0, 3}: min 0, mean 6/6 = 1, max 3."""
    loss, m = reward_loss(_t(RC), _t(RR))
    expected = (2 + 2 * math.log1p(math.exp(-2)) + math.log(2)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(0.982334, abs=1e-6)
    assert m["accuracy"].item() == pytest.approx(1 / 3)
    assert m["margin"].item() == 0.0
    assert (m["reward_min"].item(), m["reward_mean"].item(), m["reward_max"].item()) == (0.0, 1.0, 3.0)
    assert not any(v.requires_grad for v in m.values())


def test_gradient_is_minus_sigmoid_of_minus_d_over_b():
    """∂/∂r_c of -log σ(d)/B is -σ(-d)/B; for r_r it is +σ(-d)/B. d = [2, 0, -2], B = 3."""
    rc, rr = _t(RC, requires_grad=True), _t(RR, requires_grad=True)
    reward_loss(rc, rr)[0].backward()
    sig = torch.sigmoid(-_t([2.0, 0.0, -2.0]))
    assert torch.allclose(rc.grad, -sig / 3) and torch.allclose(rr.grad, sig / 3)
    assert rc.grad[1].item() == pytest.approx(-0.5 / 3)


def test_swapping_sides_changes_the_loss_by_the_mean_difference():
    """-log σ(x) - (-log σ(-x)) = -x, so loss(r_c, r_r) - loss(r_r, r_c) = -mean(d) for any rewards."""
    rc, rr = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    forward, backward = reward_loss(rc, rr)[0], reward_loss(rr, rc)[0]
    assert (forward - backward).item() == pytest.approx(-(rc - rr).mean().item(), abs=1e-12)


def test_margin_shifts_each_pair():
    """m = [1, 0, -2]: d - m = [1, 0, 0] -> (log(1+e^-1) + 2·log 2) / 3 ≈ 0.56652.
    Accuracy and the logged margin are about r_c - r_r only, so they stay 1/3 and 0."""
    loss, m = reward_loss(_t(RC), _t(RR), margin=_t([1.0, 0.0, -2.0]))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + 2 * math.log(2)) / 3, abs=1e-12)
    assert loss.item() == pytest.approx(0.566519, abs=1e-6)
    assert m["accuracy"].item() == pytest.approx(1 / 3) and m["margin"].item() == 0.0


def test_centering_term():
    """r_c + r_r = [2, 0, 4] -> mean of squares (4 + 0 + 16) / 3 = 20/3; with c = 0.01 the loss
    grows by 0.2/3. c = 0 and c = None give the plain loss."""
    plain = reward_loss(_t(RC), _t(RR))[0].item()
    centred = reward_loss(_t(RC), _t(RR), center_rewards_coefficient=0.01)[0].item()
    assert centred - plain == pytest.approx(0.01 * 20 / 3, abs=1e-12)
    assert reward_loss(_t(RC), _t(RR), center_rewards_coefficient=0.0)[0].item() == plain


def test_half_precision_is_computed_in_float32():
    loss, _ = reward_loss(torch.tensor(RC, dtype=torch.bfloat16), torch.tensor(RR, dtype=torch.bfloat16))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.982334, abs=1e-6)  # the inputs are exact in bf16


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"rejected_rewards has shape \(2,\): expected \(3,\)"):
        reward_loss(_t(RC), _t(RR[:2]))
    with pytest.raises(ValueError, match=r"margin has shape \(3, 1\)"):
        reward_loss(_t(RC), _t(RR), margin=_t([[0.0], [0.0], [0.0]]))
    with pytest.raises(ValueError, match=r"chosen_rewards has shape \(3, 1\): expected \(B,\)"):
        reward_loss(_t([[0.0], [0.0], [0.0]]), _t([[0.0], [0.0], [0.0]]))
    with pytest.raises(ValueError, match="center_rewards_coefficient = -0.1: must be >= 0"):
        reward_loss(_t(RC), _t(RR), center_rewards_coefficient=-0.1)
