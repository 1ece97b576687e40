"""Preference losses (DPO variants, KTO) on two-pair batches with hand-derived values.

The shared batch, in float64 so the comparisons are exact to far below 1e-6, with β = 1:

  pair 0: r_c = log 3, r_r = 0      → Δ = r_c - r_r = +log 3,  σ(Δ) = 3/4
  pair 1: r_c = 0,     r_r = log 3  → Δ = -log 3,              σ(Δ) = 1/4

where r = logps - ref_logps; σ(log 3) = 3/(3+1) = 3/4 keeps every term a simple fraction.
"""
import math

import pytest
import torch

from stages.losses import DPO_LOSSES, dpo_loss, kto_loss

LOG3 = math.log(3)
REF = -2.0  # reference log-prob of every response; only the differences matter


def _batch():
    ref = torch.full((2,), REF, dtype=torch.float64)
    chosen = ref + torch.tensor([LOG3, 0.0], dtype=torch.float64)
    rejected = ref + torch.tensor([0.0, LOG3], dtype=torch.float64)
    return chosen, rejected, ref.clone(), ref.clone()


def _check(losses, expected):
    assert losses.shape == (2,)
    for got, want in zip(losses.tolist(), expected, strict=True):
        assert math.isclose(got, want, abs_tol=1e-6), (losses.tolist(), expected)


def test_sigmoid():
    """-log σ(Δ): pair 0 -log(3/4) = log(4/3); pair 1 -log(1/4) = log 4."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="sigmoid")
    _check(losses, [math.log(4 / 3), math.log(4)])


def test_sigmoid_label_smoothing_is_conservative_dpo():
    """ε = 0.1: -(0.9)·log σ(Δ) - 0.1·log σ(-Δ).

    pair 0: 0.9·log(4/3) + 0.1·log 4;  pair 1: 0.9·log 4 + 0.1·log(4/3).
    """
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="sigmoid", label_smoothing=0.1)
    _check(losses, [0.9 * math.log(4 / 3) + 0.1 * math.log(4), 0.9 * math.log(4) + 0.1 * math.log(4 / 3)])


def test_hinge():
    """relu(1 - Δ): pair 0 relu(1 - log 3) = 0 since log 3 ≈ 1.0986 > 1; pair 1 1 + log 3."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="hinge")
    _check(losses, [0.0, 1 + LOG3])


def test_ipo():
    """(Δ - 1/(2β))² with 1/(2β) = 0.5: (log 3 - 0.5)² and (-log 3 - 0.5)²."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="ipo")
    _check(losses, [(LOG3 - 0.5) ** 2, (LOG3 + 0.5) ** 2])


def test_ipo_target_depends_on_beta():
    """β = 0.25: target margin 1/(2β) = 2, so (log 3 - 2)² for pair 0."""
    losses, _, _ = dpo_loss(*_batch(), beta=0.25, loss_type="ipo")
    assert math.isclose(losses[0].item(), (LOG3 - 2) ** 2, abs_tol=1e-6)


def test_robust():
    """ε = 0.1: [-(0.9)·log σ(Δ) + 0.1·log σ(-Δ)] / 0.8.

    pair 0: [0.9·log(4/3) - 0.1·log 4] / 0.8;  pair 1: [0.9·log 4 - 0.1·log(4/3)] / 0.8.
    """
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="robust", label_smoothing=0.1)
    _check(losses, [(0.9 * math.log(4 / 3) - 0.1 * math.log(4)) / 0.8,
                    (0.9 * math.log(4) - 0.1 * math.log(4 / 3)) / 0.8])


def test_robust_without_noise_is_sigmoid():
    """ε = 0: both reduce to -log σ(βΔ)."""
    robust, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="robust")
    _check(robust, [math.log(4 / 3), math.log(4)])


def test_kto_pair():
    """KL_c = max(0, mean r_c) = log3/2 and KL_r = log3/2.

    pair 0: ½[(1 - σ(log 3 - log3/2)) + (1 - σ(log3/2 - 0))] = 1 - σ(½ log 3) = 1/(1 + √3)
    pair 1: ½[(1 - σ(0 - log3/2)) + (1 - σ(log3/2 - log 3))] = 1 - σ(-½ log 3) = √3/(1 + √3)
    (σ(½ log 3) = √3/(√3 + 1)).
    """
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="kto_pair")
    s3 = math.sqrt(3)
    _check(losses, [1 / (1 + s3), s3 / (1 + s3)])


def test_kto_pair_clamps_negative_kl_to_zero():
    """Every ratio -log 3: the KL means are -log 3, clamped to 0.

    Each pair: ½[(1 - σ(-log 3)) + (1 - σ(0 + log 3))] = ½[3/4 + 1/4] = ½.
    """
    x = torch.full((2,), -LOG3, dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    losses, _, _ = dpo_loss(x, x, zero, zero, beta=1.0, loss_type="kto_pair")
    _check(losses, [0.5, 0.5])


def test_kto_pair_uses_the_other_halfs_kl():
    """r_c = [log 3, log 3], r_r = [0, -2]: KL_c = log 3, KL_r = max(0, -1) = 0.

    pair 0: ½[(1 - σ(log 3 - 0)) + (1 - σ(log 3 - 0))] = ½[1/4 + 1/4] = 1/4
    pair 1: ½[(1 - σ(log 3)) + (1 - σ(log 3 + 2))] = ½[1/4 + 1/(1 + 3e²)]
    (Using its own half's KL for the chosen term would give pair 0 ½[1/2 + 1/4] instead.)
    """
    zero = torch.zeros(2, dtype=torch.float64)
    chosen = torch.tensor([LOG3, LOG3], dtype=torch.float64)
    rejected = torch.tensor([0.0, -2.0], dtype=torch.float64)
    losses, _, _ = dpo_loss(chosen, rejected, zero, zero, beta=1.0, loss_type="kto_pair")
    _check(losses, [0.25, 0.5 * (0.25 + 1 / (1 + 3 * math.exp(2)))])


def test_bco_pair_with_the_batch_mean_as_delta():
    """δ = mean(β r_c, β r_r) = mean(log 3, 0, 0, log 3) = log3/2 (the running mean after this one batch).

    pair 0: -log σ(log 3 - log3/2) - log σ(-(0 - log3/2)) = -2·log σ(½ log 3) = 2·log((1+√3)/√3)
    pair 1: -log σ(0 - log3/2) - log σ(-(log 3 - log3/2)) = -2·log σ(-½ log 3) = 2·log(1+√3)
    """
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="bco_pair", bco_delta=LOG3 / 2)
    s3 = math.sqrt(3)
    _check(losses, [2 * math.log((1 + s3) / s3), 2 * math.log(1 + s3)])


def test_bco_pair_needs_delta():
    """δ is state over training (the trainer's running mean); the pure loss never falls back to the batch mean."""
    with pytest.raises(ValueError, match="'bco_pair' needs bco_delta, the running mean"):
        dpo_loss(*_batch(), beta=1.0, loss_type="bco_pair")


def test_bco_pair_with_given_delta():
    """δ = 0: pair 0 -log σ(log 3) - log σ(0) = log(4/3) + log 2;
    pair 1 -log σ(0) - log σ(-log 3) = log 2 + log 4."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="bco_pair", bco_delta=0.0)
    _check(losses, [math.log(4 / 3) + math.log(2), math.log(2) + math.log(4)])


def test_sppo_hard():
    """(r_c - ½)² + (r_r + ½)²: pair 0 (log 3 - ½)² + ¼; pair 1 ¼ + (log 3 + ½)²."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="sppo_hard")
    _check(losses, [(LOG3 - 0.5) ** 2 + 0.25, 0.25 + (LOG3 + 0.5) ** 2])


def test_nca_pair():
    """-log σ(r_c) - ½[log σ(-r_c) + log σ(-r_r)].

    pair 0: σ(log 3) = 3/4, σ(-log 3) = 1/4, σ(0) = 1/2 → log(4/3) + ½(log 4 + log 2)
    pair 1: σ(0) = 1/2, σ(-log 3) = 1/4               → log 2 + ½(log 2 + log 4)
    """
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="nca_pair")
    _check(losses, [math.log(4 / 3) + 0.5 * (math.log(4) + math.log(2)),
                    math.log(2) + 0.5 * (math.log(2) + math.log(4))])


def test_apo_zero():
    """(1 - σ(r_c)) + σ(r_r): pair 0 1/4 + 1/2 = 0.75; pair 1 1/2 + 3/4 = 1.25."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="apo_zero")
    _check(losses, [0.75, 1.25])


def test_apo_down():
    """σ(r_c) + (1 - σ(r_c - r_r)): pair 0 3/4 + 1/4 = 1.0; pair 1 1/2 + 3/4 = 1.25."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="apo_down")
    _check(losses, [1.0, 1.25])


def test_discopop():
    """τ = 1, so the mix m = σ(Δ): pair 0 m = 3/4, -log σ(Δ) = log(4/3), exp(-Δ) = 1/3:
    (1/4)·log(4/3) + (3/4)·(1/3); pair 1 m = 1/4, -log σ(Δ) = log 4, exp(-Δ) = 3: (3/4)·log 4 + (1/4)·3."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="discopop", discopop_tau=1.0)
    _check(losses, [math.log(4 / 3) / 4 + 1 / 4, 0.75 * math.log(4) + 0.75])


def test_discopop_at_a_small_temperature_is_logistic_below_zero_and_exponential_above():
    """τ = 0.01: m = σ(100·Δ) ≈ 1 for pair 0 (exp(-log 3) = 1/3), ≈ 0 for pair 1 (-log σ(-log 3) = log 4)."""
    losses, _, _ = dpo_loss(*_batch(), beta=1.0, loss_type="discopop", discopop_tau=0.01)
    _check(losses, [1 / 3, math.log(4)])


@pytest.mark.parametrize("divergence, alpha, loss_type, expected", [
    # forward KL scores r as 1 - e^(-r): r_c = log 3 -> 2/3, r = 0 -> 0, so Δ = ±2/3; sigmoid: log(1 + e^(∓2/3))
    ("forward_kl", 0.5, "sigmoid", [math.log(1 + math.exp(-2 / 3)), math.log(1 + math.exp(2 / 3))]),
    # JS scores r as log 2 + log σ(r): log 3 -> log 2 + log(3/4) = log(3/2), 0 -> 0; Δ = ±log(3/2),
    # σ(log 3/2) = 3/5: -log(3/5) = log(5/3) and -log(2/5) = log(5/2)
    ("js_divergence", 0.5, "sigmoid", [math.log(5 / 3), math.log(5 / 2)]),
    # α = 1/2 scores r as (e^(-r/2) - 1)/(-1/2) = 2(1 - e^(-r/2)): log 3 -> 2 - 2/√3, 0 -> 0;
    # hinge relu(1 - Δ): 1 - (2 - 2/√3) = 2/√3 - 1 and 1 + 2 - 2/√3 = 3 - 2/√3
    ("alpha_divergence", 0.5, "hinge", [2 / math.sqrt(3) - 1, 3 - 2 / math.sqrt(3)]),
    # α = 1 is the reverse-KL limit: DPO's own sigmoid values
    ("alpha_divergence", 1.0, "sigmoid", [math.log(4 / 3), math.log(4)]),
])
def test_f_divergence_scores_the_log_ratios(divergence, alpha, loss_type, expected):
    losses, chosen_rewards, rejected_rewards = dpo_loss(*_batch(), beta=1.0, loss_type=loss_type,
                                                        f_divergence_type=divergence, f_alpha_divergence_coef=alpha)
    _check(losses, expected)
    _check(chosen_rewards, [LOG3, 0.0])  # the implicit rewards stay β·r
    _check(rejected_rewards, [0.0, LOG3])


def test_f_divergence_refuses_variants_that_do_not_score_the_margin():
    with pytest.raises(ValueError, match="f_divergence_type = 'forward_kl' applies to loss_type sigmoid, hinge"):
        dpo_loss(*_batch(), beta=1.0, loss_type="apo_zero", f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="f_divergence_type = 'kl' is not supported"):
        dpo_loss(*_batch(), beta=1.0, f_divergence_type="kl")


def test_every_registered_loss_has_a_test_above():
    assert set(DPO_LOSSES) == {"sigmoid", "hinge", "ipo", "robust", "kto_pair", "bco_pair", "sppo_hard",
                               "nca_pair", "apo_zero", "apo_down", "discopop"}


def test_rewards_are_beta_times_logratio_and_detached():
    """β = 0.5: chosen rewards 0.5·[log 3, 0], rejected 0.5·[0, log 3]; no gradient through them."""
    chosen, rejected, ref_c, ref_r = _batch()
    chosen.requires_grad_(True)
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.5)
    _check(chosen_rewards, [0.5 * LOG3, 0.0])
    _check(rejected_rewards, [0.0, 0.5 * LOG3])
    assert not chosen_rewards.requires_grad and losses.requires_grad


def test_sigmoid_gradient():
    """d/dc of -log σ(β(c - ...)) = -β·(1 - σ(βΔ)): pair 0 -(1/4), pair 1 -(3/4) with β = 1."""
    chosen, rejected, ref_c, ref_r = _batch()
    chosen.requires_grad_(True)
    losses, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=1.0)
    losses.sum().backward()
    _check(chosen.grad, [-0.25, -0.75])


def test_reference_free_ignores_the_reference():
    """reference_free: r = logps. chosen = [log 3, 0], rejected = [0, log 3] → the same as the shared batch,
    while the reference tensors (here wildly different) play no part; rewards are β·logps.
    """
    chosen = torch.tensor([LOG3, 0.0], dtype=torch.float64)
    rejected = torch.tensor([0.0, LOG3], dtype=torch.float64)
    junk = torch.tensor([5.0, -7.0], dtype=torch.float64)
    losses, chosen_rewards, _ = dpo_loss(chosen, rejected, junk, -junk, beta=1.0, reference_free=True)
    _check(losses, [math.log(4 / 3), math.log(4)])
    _check(chosen_rewards, [LOG3, 0.0])
    losses_none, _, _ = dpo_loss(chosen, rejected, None, None, beta=1.0, reference_free=True)
    assert torch.equal(losses, losses_none)


def test_half_precision_is_computed_in_float32():
    chosen, rejected, ref_c, ref_r = (t.to(torch.bfloat16) for t in _batch())
    losses, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=1.0)
    assert losses.dtype == torch.float32


@pytest.mark.parametrize("name, kwargs, fragment", [
    ("rejected_logps", {"rejected_logps": torch.zeros(3)}, "rejected_logps has shape (3,): expected (2,)"),
    ("ref_chosen_logps", {"ref_chosen_logps": torch.zeros(2, 1)}, "ref_chosen_logps has shape (2, 1)"),
    ("beta", {"beta": 0.0}, "beta = 0.0"),
    ("beta negative", {"beta": -0.1}, "must be > 0"),
    ("label_smoothing", {"label_smoothing": 0.5}, "label_smoothing = 0.5"),
    ("label_smoothing negative", {"label_smoothing": -0.1}, "[0, 0.5)"),
    ("loss_type", {"loss_type": "sigmiod"}, "'apo_down', 'apo_zero', 'bco_pair'"),
    ("missing reference", {"ref_chosen_logps": None}, "reference_free=True"),
])
def test_bad_inputs(name, kwargs, fragment):
    args = dict(zip(["chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps"],
                    (t.float() for t in _batch()), strict=True), beta=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        dpo_loss(**args)
    assert fragment in str(err.value)


def test_chosen_must_be_one_dimensional():
    with pytest.raises(ValueError, match=r"chosen_logps has shape \(2, 1\): expected \(B,\)"):
        dpo_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), beta=0.1)


# ---------------------------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------------------------

def _kto_inputs():
    """Both rows have r = policy - ref = log 3; row 0 desirable, row 1 undesirable."""
    policy = torch.tensor([LOG3 - 1.0, LOG3 - 4.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -4.0], dtype=torch.float64)
    labels = torch.tensor([True, False])
    return policy, ref, labels


def test_kto_desirable_and_undesirable():
    """z = 0, β = 1: desirable 1 - σ(log 3) = 1/4; undesirable 1 - σ(-log 3) = 3/4."""
    policy, ref, labels = _kto_inputs()
    losses = kto_loss(policy, ref, torch.tensor(0.0), labels, beta=1.0)
    _check(losses, [0.25, 0.75])


def test_kto_weights():
    """desirable_weight 2, undesirable_weight 0.5: [2·1/4, 0.5·3/4] = [0.5, 0.375]."""
    policy, ref, labels = _kto_inputs()
    losses = kto_loss(policy, ref, 0.0, labels, beta=1.0, desirable_weight=2.0, undesirable_weight=0.5)
    _check(losses, [0.5, 0.375])


def test_kto_reference_point_shifts_both():
    """z = log 3: desirable 1 - σ(0) = 1/2; undesirable 1 - σ(0) = 1/2. With β = 0.5, z = 0:
    desirable 1 - σ(½ log 3) = 1/(1 + √3)."""
    policy, ref, labels = _kto_inputs()
    _check(kto_loss(policy, ref, LOG3, labels, beta=1.0), [0.5, 0.5])
    assert math.isclose(kto_loss(policy, ref, 0.0, labels, beta=0.5)[0].item(), 1 / (1 + math.sqrt(3)),
                        abs_tol=1e-6)


def test_kto_negative_kl_is_clamped_and_kl_gets_no_gradient():
    """kl = -5 is clamped to 0: the z = 0 values [1/4, 3/4]; kl is detached, so it gets no gradient."""
    policy, ref, labels = _kto_inputs()
    kl = torch.tensor(-5.0, dtype=torch.float64, requires_grad=True)
    policy.requires_grad_(True)
    losses = kto_loss(policy, ref, kl, labels, beta=1.0)
    _check(losses, [0.25, 0.75])
    losses.sum().backward()
    assert kl.grad is None
    # desirable: d/dr (1 - σ(r)) = -σ(r)·σ(-r) = -3/16; undesirable: d/dr (1 - σ(-r)) = +σ(-r)·σ(r) = +3/16
    _check(policy.grad, [-3 / 16, 3 / 16])


def test_kto_bad_inputs():
    policy, ref, labels = _kto_inputs()
    with pytest.raises(ValueError, match=r"labels has shape \(3,\): expected \(2,\)"):
        kto_loss(policy, ref, 0.0, torch.tensor([True, False, True]), beta=1.0)
    with pytest.raises(ValueError, match="beta = 0"):
        kto_loss(policy, ref, 0.0, labels, beta=0)


def test_apo_zero_unpaired_ignores_the_reference_point():
    """β = 1, r = log 3 on both rows: desirable 1 - σ(log 3) = 1/4, undesirable σ(log 3) = 3/4; the same with a
    KL of 5 (kto would shift both by it). Weights 2 and 3 scale each side: 1/2 and 9/4."""
    policy, ref, labels = _kto_inputs()
    for kl in (0.0, 5.0):
        _check(kto_loss(policy, ref, torch.tensor(kl), labels, beta=1.0, loss_type="apo_zero_unpaired"), [0.25, 0.75])
    _check(kto_loss(policy, ref, 0.0, labels, beta=1.0, loss_type="apo_zero_unpaired", desirable_weight=2.0,
                    undesirable_weight=3.0), [0.5, 2.25])


def test_kto_loss_type_is_checked():
    policy, ref, labels = _kto_inputs()
    with pytest.raises(ValueError, match=r"loss_type = 'apo_zero' is not supported; choose one of "
                                         r"\['apo_zero_unpaired', 'kto'\]"):
        kto_loss(policy, ref, 0.0, labels, beta=1.0, loss_type="apo_zero")
