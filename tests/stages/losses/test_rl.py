"""RL losses (GRPO advantages and loss, GAE, PPO) on tiny hand-made tensors, float64 throughout."""
import math

import pytest
import torch

from stages.losses import (
    GRPO_AGGREGATIONS,
    GRPO_POLICY_TERMS,
    KL_ESTIMATORS,
    explained_variance,
    gae,
    grpo_advantages,
    grpo_loss,
    kl_k1,
    kl_k3,
    masked_whiten,
    per_token_rewards,
    ppo_loss,
)

F64 = torch.float64


def _close(t, expected, tol=1e-6):
    got = t.tolist() if isinstance(t, torch.Tensor) else t
    if not isinstance(expected, list):
        assert math.isclose(got, expected, abs_tol=tol), (got, expected)
        return
    got = torch.tensor(got, dtype=F64).flatten().tolist()
    expected = torch.tensor(expected, dtype=F64).flatten().tolist()
    assert len(got) == len(expected) and all(math.isclose(g, e, abs_tol=tol)
                                             for g, e in zip(got, expected, strict=True)), \
        (got, expected)


# ---------------------------------------------------------------------------------------------
# grpo_advantages
# ---------------------------------------------------------------------------------------------
# Two prompts, G = 3: group 0 = [1, 2, 3] (mean 2, deviations [-1, 0, 1], unbiased std √(2/2) = 1),
# group 1 = [4, 4, 10] (mean 6, deviations [-2, -2, 4], unbiased std √(24/2) = √12).
# The whole batch [1, 2, 3, 4, 4, 10]: mean 4, deviations [-3, -2, -1, 0, 0, 6], squares sum 50,
# unbiased std √(50/5) = √10.
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 10.0], dtype=F64)
DEVIATIONS = [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]


def test_grpo_advantages_group_scaling():
    """A = (r - group mean) / (group std + 1e-4)."""
    adv = grpo_advantages(REWARDS, 3)
    s0, s1 = 1 + 1e-4, math.sqrt(12) + 1e-4
    _close(adv, [-1 / s0, 0.0, 1 / s0, -2 / s1, -2 / s1, 4 / s1])


def test_grpo_advantages_batch_scaling():
    """A = (r - group mean) / (std of all six rewards + 1e-4) = deviations / (√10 + 1e-4).

    The std is of the rewards, not of the centred advantages (that would be √(26/5)).
    """
    adv = grpo_advantages(REWARDS, 3, scale_rewards="batch")
    _close(adv, [d / (math.sqrt(10) + 1e-4) for d in DEVIATIONS])


def test_grpo_advantages_no_scaling():
    _close(grpo_advantages(REWARDS, 3, scale_rewards="none"), DEVIATIONS)


def test_grpo_advantages_groups_are_consecutive_runs():
    """G = 2 regroups the same rewards: [1, 2] [3, 4] [4, 10] → deviations [-½, ½, -½, ½, -3, 3]."""
    _close(grpo_advantages(REWARDS, 2, scale_rewards="none"), [-0.5, 0.5, -0.5, 0.5, -3.0, 3.0])


def test_grpo_advantages_equal_rewards_give_zero():
    adv = grpo_advantages(torch.tensor([5.0, 5.0, 5.0, 0.0, 1.0, 2.0]), 3)
    assert adv[:3].abs().max().item() == 0.0 and adv[3:].abs().max().item() > 0.5


def test_grpo_advantages_unscored_rows_are_left_out():
    """Row 1 unscored (NaN, valid False). Group 0's scored rewards [1, 3]: mean 2, deviations [-1, 1],
    unbiased std √(2/1) = √2; the unscored row gets 0. Group 1 is untouched: [-2, -2, 4] / (√12 + 1e-4).
    Batch scaling uses the five scored rewards [1, 3, 4, 4, 10]: mean 4.4, squared deviations
    11.56 + 1.96 + 0.16 + 0.16 + 31.36 = 45.2, unbiased std √(45.2/4) = √11.3.
    """
    rewards = torch.tensor([1.0, float("nan"), 3.0, 4.0, 4.0, 10.0], dtype=F64)
    valid = torch.tensor([True, False, True, True, True, True])
    s0, s1 = math.sqrt(2) + 1e-4, math.sqrt(12) + 1e-4
    _close(grpo_advantages(rewards, 3, valid=valid), [-1 / s0, 0.0, 1 / s0, -2 / s1, -2 / s1, 4 / s1])
    sb = math.sqrt(11.3) + 1e-4
    _close(grpo_advantages(rewards, 3, valid=valid, scale_rewards="batch"),
           [-1 / sb, 0.0, 1 / sb, -2 / sb, -2 / sb, 4 / sb])
    # The placeholder value of an unscored row is irrelevant.
    other = rewards.clone()
    other[1] = 1000.0
    assert torch.equal(grpo_advantages(other, 3, valid=valid), grpo_advantages(rewards, 3, valid=valid))


def test_grpo_advantages_group_with_one_scored_row_is_zero():
    """One scored completion has no baseline to compare against: advantage 0 (no NaN from a 0/0 std)."""
    adv = grpo_advantages(torch.tensor([5.0, 0.0, 0.0, 1.0, 2.0, 3.0]), 3,
                          valid=torch.tensor([True, False, False, True, True, True]))
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and not adv.isnan().any() and adv[3:].abs().max() > 0.5


def test_grpo_advantages_bad_inputs():
    with pytest.raises(ValueError, match="not divisible by num_generations = 4"):
        grpo_advantages(REWARDS, 4)
    with pytest.raises(ValueError, match="num_generations = 1"):
        grpo_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match=r"\['batch', 'group', 'none'\]"):
        grpo_advantages(REWARDS, 3, scale_rewards="std")
    with pytest.raises(ValueError, match=r"valid has shape \(5,\): expected \(6,\)"):
        grpo_advantages(REWARDS, 3, valid=torch.ones(5, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# grpo_loss
# ---------------------------------------------------------------------------------------------

def _grpo_inputs():
    """B = 2, T = 3, old_logps = 0, so ratios ρ = exp(logps) = [1, 1.5, 0.5] in both rows; ε = 0.2.

    Row 0, A = +1, mask [1, 1, 1]: -min(ρA, clip(ρ)A) = [-1, -min(1.5, 1.2), -min(0.5, 0.8)]
        = [-1, -1.2, -0.5]; sum -2.7 over 3 tokens (the 1.5 is clipped high).
    Row 1, A = -2, mask [1, 0, 1]: -min(-2ρ, -2 clip(ρ)) = 2·max(ρ, clip(ρ)) = [2, (3, masked), 1.6];
        sum 3.6 over 2 tokens (the 0.5 is clipped low).
    """
    logps = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]], dtype=F64)).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    advantages = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    return logps, old, advantages, mask


@pytest.mark.parametrize("loss_type, num_items, expected", [
    ("grpo", None, (-2.7 / 3 + 3.6 / 2) / 2),   # per-sequence means -0.9 and 1.8, averaged: 0.45
    ("bnpo", None, (-2.7 + 3.6) / 5),            # 0.9 over 5 tokens: 0.18
    ("dr_grpo", None, (-2.7 + 3.6) / (2 * 8)),   # over B·max_completion_length = 2·8 (not B·T = 6): 0.05625
    ("dapo", 9, (-2.7 + 3.6) / 9),               # over the global token count 9: 0.1
    ("dapo", None, (-2.7 + 3.6) / 5),            # falls back to the local count 5
])
def test_grpo_loss_aggregations(loss_type, num_items, expected):
    logps, old, advantages, mask = _grpo_inputs()
    loss, metrics = grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type=loss_type,
                              num_items_in_batch=num_items, max_completion_length=8)
    _close(loss.item(), expected)
    assert "kl" not in metrics


def _pad_columns(t, n, value):
    return torch.cat([t, torch.full((t.shape[0], n), value, dtype=t.dtype)], dim=1)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo", "bnpo", "grpo"])
def test_grpo_loss_ignores_padding_columns(loss_type):
    """Two padding columns (mask 0, arbitrary log-probs) change neither loss nor gradient.

    Dr. GRPO divides by the constant B·max_completion_length = 2·8: (-2.7 + 3.6)/16 with or without
    padding. Dividing by the tensor's B·T instead (the earlier version) gave 0.9/6 = 0.15 and 0.9/10 = 0.09.
    """
    logps, old, advantages, mask = _grpo_inputs()
    padded = _pad_columns(logps.detach(), 2, -3.0).requires_grad_(True)
    kw = dict(beta=0.0, loss_type=loss_type, max_completion_length=8)
    loss, _ = grpo_loss(logps, old, None, advantages, mask, **kw)
    loss_padded, _ = grpo_loss(padded, _pad_columns(old, 2, 0.0), None, advantages, _pad_columns(mask, 2, 0), **kw)
    (loss + loss_padded).backward()
    _close(loss_padded.item(), loss.item(), tol=1e-12)
    assert torch.equal(padded.grad[:, :3], logps.grad) and padded.grad[:, 3:].abs().max() == 0
    if loss_type == "dr_grpo":
        _close(loss.item(), 0.9 / 16)


def test_grpo_aggregations_all_tested():
    """The four above, plus the variants' own (tests/stages/losses/test_grpo_variants.py): sapo as grpo, cispo
    and vespo as dapo, luspo a per-sequence sum."""
    assert set(GRPO_AGGREGATIONS) == set(GRPO_POLICY_TERMS) == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo",
                                                               "cispo", "vespo"}


def test_grpo_clip_metrics():
    """Of the 5 masked tokens: row 1's ρ = 0.5 < 0.8 with A < 0 is clipped low (1/5); row 0's ρ = 1.5 > 1.2
    with A > 0 is clipped high (1/5). Row 1's masked ρ = 1.5 and row 0's ρ = 0.5 with A > 0 do not count.
    """
    logps, old, advantages, mask = _grpo_inputs()
    _, metrics = grpo_loss(logps, old, None, advantages, mask, beta=0.0)
    _close(metrics["clip_ratio/low_mean"].item(), 0.2)
    _close(metrics["clip_ratio/high_mean"].item(), 0.2)
    _close(metrics["clip_ratio/region_mean"].item(), 0.4)
    assert not any(m.requires_grad for m in metrics.values())


def test_grpo_epsilon_high():
    """ε_high = 0.6: row 0's ρ = 1.5 < 1.6 is no longer clipped, so its token costs -1.5:
    row 0 mean (-1 - 1.5 - 0.5)/3 = -1, grpo loss (-1 + 1.8)/2 = 0.4, no high clipping."""
    logps, old, advantages, mask = _grpo_inputs()
    loss, metrics = grpo_loss(logps, old, None, advantages, mask, beta=0.0, epsilon_high=0.6)
    _close(loss.item(), 0.4)
    _close(metrics["clip_ratio/high_mean"].item(), 0.0)
    _close(metrics["clip_ratio/low_mean"].item(), 0.2)


def test_grpo_gradient_is_zero_on_clipped_tokens():
    """grpo weights each token by 1/(len · B): row 0 by 1/6, row 1 by 1/4. d(-ρA)/dlogp = -ρA.

    row 0: ρ = 1 → -1/6; ρ = 1.5 clipped → 0; ρ = 0.5 (A > 0, not clipped) → -0.5/6
    row 1: ρ = 1, A = -2 → 2/4; masked → 0; ρ = 0.5 clipped → 0
    """
    logps, old, advantages, mask = _grpo_inputs()
    loss, _ = grpo_loss(logps, old, None, advantages, mask, beta=0.0)
    loss.backward()
    _close(logps.grad, [[-1 / 6, 0.0, -0.5 / 6], [0.5, 0.0, 0.0]])


def test_grpo_kl_term():
    """β = 0.1, ref - logps = log 2 on row 0 and 0 on row 1: k3 = e^d - d - 1 = 1 - log 2 on row 0, 0 on row 1.

    grpo: 0.45 + 0.1·(1 - log 2 + 0)/2; bnpo: 0.18 + 0.1·3(1 - log 2)/5; metric kl = 3(1 - log 2)/5.
    """
    logps, old, advantages, mask = _grpo_inputs()
    ref = logps.detach() + torch.tensor([[math.log(2)], [0.0]], dtype=F64)
    loss, metrics = grpo_loss(logps, old, ref, advantages, mask, beta=0.1)
    _close(loss.item(), 0.45 + 0.1 * (1 - math.log(2)) / 2)
    _close(metrics["kl"].item(), 3 * (1 - math.log(2)) / 5)
    loss, _ = grpo_loss(logps, old, ref, advantages, mask, beta=0.1, loss_type="bnpo")
    _close(loss.item(), 0.18 + 0.1 * 3 * (1 - math.log(2)) / 5)


def test_grpo_old_logps_none_means_ratio_one():
    """Without old log-probs ρ = 1, so the loss is -mean(A) per token: grpo = -(1 - 2)/2 = 0.5."""
    logps, _, advantages, mask = _grpo_inputs()
    loss, metrics = grpo_loss(logps, None, None, advantages, mask, beta=0.0)
    _close(loss.item(), 0.5)
    _close(metrics["clip_ratio/region_mean"].item(), 0.0)


def test_grpo_dapo_accumulation_is_exact():
    """Two micro-batches of one row each, summed with the global token count, equal the full batch."""
    logps, old, advantages, mask = _grpo_inputs()
    full, _ = grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type="dapo")
    parts = sum(grpo_loss(logps[i:i + 1], old[i:i + 1], None, advantages[i:i + 1], mask[i:i + 1], beta=0.0,
                          loss_type="dapo", num_items_in_batch=5)[0] for i in range(2))
    _close(parts.item(), full.item())


def test_grpo_loss_bad_inputs():
    logps, old, advantages, mask = _grpo_inputs()
    with pytest.raises(ValueError, match="ref_logps is None but beta = 0.1"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"\['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', 'luspo', 'sapo', 'vespo'\]"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type="ppo")
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\): expected \(2,\)"):
        grpo_loss(logps, old, None, torch.zeros(3), mask, beta=0.0)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\): expected \(2, 3\)"):
        grpo_loss(logps, old, None, advantages, mask[:, :2], beta=0.0)
    with pytest.raises(ValueError, match="max_completion_length = None: loss_type 'dr_grpo' divides"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="a completion has 3 loss tokens > max_completion_length = 2"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, loss_type="dr_grpo", max_completion_length=2)
    with pytest.raises(ValueError, match=r"importance_sampling_level = 'seq' is not supported; choose one of "
                       r"\['sequence', 'token'\]"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, importance_sampling_level="seq")
    with pytest.raises(ValueError, match="delta = 0: must be > 0"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, delta=0)
    with pytest.raises(ValueError, match=r"sequence_mask has shape \(3,\): expected \(2,\)"):
        grpo_loss(logps, old, None, advantages, mask, beta=0.0, sequence_mask=torch.ones(3))


# ---------------------------------------------------------------------------------------------
# gae
# ---------------------------------------------------------------------------------------------

def _gae_slow(rewards, values, mask, gamma, lam):
    """The obvious version: per row, walk the valid positions backwards in plain Python."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v = next_a = 0.0
        for t in reversed([t for t in range(T) if mask[b][t]]):
            a = rewards[b][t] + gamma * next_v - values[b][t] + gamma * lam * next_a
            adv[b][t] = a
            next_v, next_a = values[b][t], a
    return adv


def test_gae_monte_carlo_when_lambda_is_one():
    """γ = λ = 1: A_t = (sum of rewards from t on) - V_t = 1 - 0.5 for every token; returns 1."""
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]], dtype=F64), torch.full((1, 3), 0.5, dtype=F64),
                   torch.ones(1, 3), gamma=1.0, lam=1.0)
    _close(adv, [[0.5, 0.5, 0.5]])
    _close(ret, [[1.0, 1.0, 1.0]])


def test_gae_td_when_lambda_is_zero():
    """λ = 0, γ = ½: A_t = r_t + ½V_{t+1} - V_t with V = [1, 2, ½], r = [0, 0, 1]:
    [0 + 1 - 1, 0 + ¼ - 2, 1 + 0 - ½] = [0, -1.75, 0.5]."""
    adv, _ = gae(torch.tensor([[0.0, 0.0, 1.0]], dtype=F64), torch.tensor([[1.0, 2.0, 0.5]], dtype=F64),
                 torch.ones(1, 3), gamma=0.5, lam=0.0)
    _close(adv, [[0.0, -1.75, 0.5]])


def test_gae_skips_masked_tokens():
    """mask [1, 0, 1], γ = λ = 1; the masked token's reward 100 and value 100 are ignored:
    A_2 = 1 - ½ = ½; A_0 = 0 + V_2 - V_0 + A_2 = ½; the masked A_1 and return are 0."""
    adv, ret = gae(torch.tensor([[0.0, 100.0, 1.0]], dtype=F64), torch.tensor([[0.5, 100.0, 0.5]], dtype=F64),
                   torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)
    _close(adv, [[0.5, 0.0, 0.5]])
    _close(ret, [[1.0, 0.0, 1.0]])


def test_gae_matches_the_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 7, dtype=F64), torch.randn(4, 7, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0],   # right padding
                         [1, 1, 0, 0, 1, 1, 0],   # a hole, then padding
                         [0, 0, 0, 0, 0, 0, 0]])  # empty
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = _gae_slow(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    _close(adv, expected, tol=1e-12)
    _close(ret, ((torch.tensor(expected, dtype=F64) + values) * mask).tolist(), tol=1e-12)


# ---------------------------------------------------------------------------------------------
# ppo_loss
# ---------------------------------------------------------------------------------------------

def _ppo_inputs():
    """One row, ρ = [1, 1.5, 0.5], A = [1, 1, -1], c = 0.2.

    policy:  -Aρ = [-1, -1.5, 0.5], -A·clip(ρ) = [-1, -1.2, 0.8], max = [-1, -1.2, 0.8] (tokens 1, 2 clipped)
    value:   v = [1, 2, 0], v_old = [1, 1, 0], R = [1, 3, 1], c_v = 0.2 → clip(v) = [1, 1.2, 0]
             (v - R)² = [0, 1, 1], (clip(v) - R)² = [0, 3.24, 1], max = [0, 3.24, 1] (token 1 clipped)
    """
    logps = torch.log(torch.tensor([[1.0, 1.5, 0.5]], dtype=F64))
    old = torch.zeros(1, 3, dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64)
    values = torch.tensor([[1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    returns = torch.tensor([[1.0, 3.0, 1.0]], dtype=F64)
    return logps, old, adv, values, old_values, returns


def test_ppo_loss_hand_computed():
    """policy = -1.4/3; value = ½·4.24/3 = 2.12/3; loss = policy + 0.1·value; clipfrac 2/3, value clipfrac 1/3,
    approx_kl = ½(log²1.5 + log²0.5)/3."""
    logps, old, adv, values, old_values, returns = _ppo_inputs()
    loss, m = ppo_loss(logps, old, adv, values, old_values, returns, torch.ones(1, 3))
    _close(m["policy_loss"].item(), -1.4 / 3)
    _close(m["value_loss"].item(), 2.12 / 3)
    _close(loss.item(), -1.4 / 3 + 0.1 * 2.12 / 3)
    _close(m["clipfrac"].item(), 2 / 3)
    _close(m["value_clipfrac"].item(), 1 / 3)
    _close(m["approx_kl"].item(), 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)


def test_ppo_value_gradient_is_zero_where_clipped():
    """Token 1's value term is the clipped one, constant in v → gradient 0. Token 2 is inside the clip range:
    d/dv 0.1·½(v - R)²/3 = 0.1·(0 - 1)/3. Token 0: v = R → 0."""
    logps, old, adv, values, old_values, returns = _ppo_inputs()
    loss, _ = ppo_loss(logps, old, adv, values, old_values, returns, torch.ones(1, 3))
    loss.backward()
    _close(values.grad, [[0.0, 0.0, -0.1 / 3]])


def test_ppo_loss_masks_tokens():
    """mask [1, 1, 0]: policy (-1 - 1.2)/2 = -1.1; value ½(0 + 3.24)/2 = 0.81; loss -1.1 + 0.081.
    Changing anything at the masked token changes nothing."""
    logps, old, adv, values, old_values, returns = _ppo_inputs()
    mask = torch.tensor([[1, 1, 0]])
    loss, m = ppo_loss(logps, old, adv, values, old_values, returns, mask)
    _close(loss.item(), -1.1 + 0.081)
    _close(m["clipfrac"].item(), 0.5)
    junk = torch.tensor([[0.0, 0.0, 50.0]], dtype=F64)
    loss2, _ = ppo_loss(logps + junk, old, adv - junk, values + junk, old_values, returns + junk, mask)
    _close(loss2.item(), loss.item(), tol=1e-12)


def test_ppo_loss_bad_shapes():
    logps, old, adv, values, old_values, returns = _ppo_inputs()
    with pytest.raises(ValueError, match=r"returns has shape \(1, 2\): expected \(1, 3\)"):
        ppo_loss(logps, old, adv, values, old_values, returns[:, :2], torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------
# KL estimators, per-token rewards, whitening (PPO's rollout maths)
# ---------------------------------------------------------------------------------------------
# logps = [-1.0, -2.0, -0.5], ref = [-1.2, -1.9, -0.5]: d = ref - logps = [-0.2, 0.1, 0].
# k1 = logps - ref = [0.2, -0.1, 0];  k3 = e^d - 1 - d = [e^-0.2 - 0.8, e^0.1 - 1.1, 0]
#    = [0.8187307531 - 0.8, 1.1051709181 - 1.1, 0] = [0.0187307531, 0.0051709181, 0].
KL_LOGPS = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
KL_REF = torch.tensor([-1.2, -1.9, -0.5], dtype=F64)


def test_kl_estimators_hand_computed():
    """k1 can be negative; k3 never is, and both are 0 where policy and reference agree."""
    _close(kl_k1(KL_LOGPS, KL_REF), [0.2, -0.1, 0.0])
    _close(kl_k3(KL_LOGPS, KL_REF), [0.0187307531, 0.0051709181, 0.0], tol=1e-9)
    assert set(KL_ESTIMATORS) == {"k1", "k3"}


def test_kl_estimators_are_unbiased():
    """Over samples weighted by π, both estimators average to KL(π || π_ref) exactly.

    π = [0.25, 0.75], π_ref = [0.5, 0.5]: KL = 0.25·ln(0.5) + 0.75·ln(1.5) = 0.1308120.
    E_π[k1] = Σ π·log(π/π_ref) = KL; E_π[k3] = Σ π·(π_ref/π - 1 - log(π_ref/π)) = Σ π_ref - 1 + KL = KL.
    """
    pi, ref = torch.tensor([0.25, 0.75], dtype=F64), torch.tensor([0.5, 0.5], dtype=F64)
    for estimator in KL_ESTIMATORS.values():
        _close((pi * estimator(pi.log(), ref.log())).sum().item(), 0.1308120, tol=1e-7)


def test_per_token_rewards_hand_derived():
    """k1: KL_t = logp - ref; r_t = -0.5·KL_t, + score at the last valid token.
    row 0: KL = [0.2, -0.1, (masked)]   -> r = [-0.1, 0.05 + 2.0, 0]
    row 1: KL = [0.4, 0.0, 0.0]         -> r = [-0.2, 0, 0 - 1.0]
    k3 at d = ref - logp = -0.2: e^-0.2 - 1 + 0.2 = 0.0187308."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], dtype=F64)
    ref = torch.tensor([[-1.2, -1.9, -9.0], [-0.9, -0.5, -0.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, kl = per_token_rewards(logps, ref, torch.tensor([2.0, -1.0]), mask, kl_coef=0.5)
    _close(rewards, [[-0.1, 2.05, 0.0], [-0.2, 0.0, -1.0]])
    _close(kl, [[0.2, -0.1, 0.0], [0.4, 0.0, 0.0]])
    _, k3 = per_token_rewards(logps, ref, torch.zeros(2), mask, kl_coef=0.5, kl_estimator="k3")
    _close(k3, [[0.0187307531, 0.0051709181, 0.0], [math.exp(-0.4) - 0.6, 0.0, 0.0]], tol=1e-9)


def test_per_token_rewards_score_goes_to_the_last_valid_token_and_empty_rows_get_none():
    """A hole in the mask does not move the score: it lands on the last 1 (column 2 of row 0); a row
    with no valid token gets no score at all."""
    zeros = torch.zeros(2, 4, dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])
    rewards, _ = per_token_rewards(zeros, zeros, torch.tensor([3.0, 5.0]), mask, kl_coef=1.0)
    _close(rewards, [[0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"kl_estimator = 'k2' is not supported; choose one of \['k1', 'k3'\]"):
        per_token_rewards(zeros, zeros, torch.zeros(2), mask, kl_coef=1.0, kl_estimator="k2")


def test_masked_whiten_hand_computed():
    """x = [1, 3, (100 masked)]: mean 2, unbiased variance ((1-2)² + (3-2)²) / (2-1) = 2, so
    (x - 2)/√2 = [-0.7071068, 0.7071068]; shift_mean=False adds the mean back: [1.2928932, 2.7071068]."""
    x = torch.tensor([[1.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    _close(masked_whiten(x, mask), [[-0.7071068, 0.7071068, 0.0]])
    _close(masked_whiten(x, mask, shift_mean=False), [[1.2928932, 2.7071068, 0.0]])


def test_explained_variance_hand_computed():
    """returns [1, 2, 3]: perfect values -> 1; constant values 2 -> residual [-1, 0, 1], variance 1 =
    Var(returns) -> 0; the masked 50 is ignored; fewer than 2 valid tokens -> NaN."""
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    _close(explained_variance(returns, returns, mask).item(), 1.0)
    _close(explained_variance(torch.full_like(returns, 2.0), returns, mask).item(), 0.0)
    assert math.isnan(explained_variance(returns, returns, torch.tensor([[1, 0, 0, 0]])).item())


def _two_shards(fn, a, b):
    """Run fn(shard, reduce) for shards a and b in two threads whose `reduce` sums over both (an all-reduce)."""
    import threading

    barrier, slots, out = threading.Barrier(2), [[], []], [None, None]

    def run(i, shard):
        def reduce(t):
            slots[i].append(t)
            barrier.wait()
            total = slots[0][-1] + slots[1][-1]
            barrier.wait()
            return total
        out[i] = fn(shard, reduce)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate((a, b))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_masked_whiten_over_shards_equals_whitening_the_whole_batch():
    """Data parallelism: each process whitens its shard with mean and variance summed over all shards."""
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = masked_whiten(x, mask)
    top, bottom = _two_shards(lambda s, r: masked_whiten(x[s], mask[s], reduce=r), slice(0, 2), slice(2, 6))
    torch.testing.assert_close(torch.cat([top, bottom]), whole)
    assert not torch.allclose(masked_whiten(x[:2], mask[:2]), whole[:2])  # a shard's own statistics differ


def test_ppo_loss_num_tokens_gives_the_whole_batch_mean_when_averaged_over_shards():
    """Two shards with 3 and 5 tokens: each divides its token sum by 8 / 2; their average is the mean of all 8."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(2, 5, generator=g) for _ in range(6)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1.0]])
    whole, _ = ppo_loss(*args, mask)
    assert ppo_loss(*args, mask, num_tokens=mask.sum())[0] == pytest.approx(whole.item())
    n = mask.sum() / 2
    shards = [ppo_loss(*[a[i:i + 1] for a in args], mask[i:i + 1], num_tokens=n)[0] for i in range(2)]
    assert ((shards[0] + shards[1]) / 2).item() == pytest.approx(whole.item())
    plain = [ppo_loss(*[a[i:i + 1] for a in args], mask[i:i + 1])[0] for i in range(2)]
    assert ((plain[0] + plain[1]) / 2).item() != pytest.approx(whole.item())  # per-shard means weight tokens unequally


# ---------------------------------------------------------------------------------------------
# truncated_importance_weights and grpo_loss's importance_weights
# ---------------------------------------------------------------------------------------------
# Policy log-probs [[ln .5, ln .2, ln .9], [ln .4, ln .1, x]], sampler [[ln .5, ln .4, ln .3], [ln .1, ln .1, y]],
# the last token masked (x, y = 0, NaN: neither may leak). Ratios π/μ: [[1, .5, 3], [4, 1, -]];
# cap 2: weights [[1, .5, 2], [2, 1, 1]]; mean ratio (1 + .5 + 3 + 4 + 1) / 5 = 1.9; capped: 3 and 4, 2 of 5.

def test_truncated_importance_weights():
    from stages.losses import truncated_importance_weights

    logps = torch.tensor([[.5, .2, .9], [.4, .1, 1.0]], dtype=F64).log()
    sampler = torch.tensor([[.5, .4, .3], [.1, .1, math.nan]], dtype=F64).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    weights, metrics = truncated_importance_weights(logps, sampler, mask, cap=2.0)
    _close(weights, [[1, .5, 2], [2, 1, 1]])
    _close(metrics["tis/mean_ratio"], 1.9)
    _close(metrics["tis/frac_capped"], 0.4)
    weights, metrics = truncated_importance_weights(logps, sampler, mask, cap=math.inf)  # measured, not capped
    _close(weights, [[1, .5, 3], [4, 1, 1]])
    _close(metrics["tis/frac_capped"], 0.0)
    with pytest.raises(ValueError, match=r"cap = 0.5: must be >= 1"):
        truncated_importance_weights(logps, sampler, mask, cap=0.5)
    with pytest.raises(ValueError, match=r"sampler_logps\[1, 2\] = nan: the sampler gave no finite log-prob"):
        truncated_importance_weights(logps, sampler, torch.ones_like(mask), cap=2.0)


def test_grpo_loss_importance_weights_scale_the_policy_gradient_term_only():
    """With old_logps None (ratio 1) the per-token loss is -w·A + β·KL; bnpo averages the 3 tokens.
    logps = ref_logps - ln 2: KL = e^{ln 2} - ln 2 - 1 = 1 - ln 2 per token. A = 2, w = [1, .5, 2]:
    loss = -(2·1 + 2·.5 + 2·2)/3 + 0.1·(1 - ln 2) = -7/3 + 0.1·(1 - ln 2);
    d loss/d logps = -w·A/3 + 0.1·(1 - e^{ln 2})/3."""
    ref = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    logps = (ref - math.log(2)).requires_grad_()
    w = torch.tensor([[1.0, 0.5, 2.0]], dtype=F64)
    loss, _ = grpo_loss(logps, None, ref, torch.tensor([2.0], dtype=F64), torch.ones_like(ref), beta=0.1,
                        loss_type="bnpo", importance_weights=w)
    _close(loss, -7 / 3 + 0.1 * (1 - math.log(2)))
    loss.backward()
    _close(logps.grad, (-w * 2 / 3 - 0.1 * (2 - 1) / 3).tolist())
    with pytest.raises(ValueError, match=r"importance_weights has shape \(3,\)"):
        grpo_loss(logps, None, ref, torch.tensor([2.0], dtype=F64), torch.ones_like(ref), beta=0.1,
                  importance_weights=w[0])


def test_ppo_loss_importance_weights_scale_the_policy_term_only():
    """w = [2, .5, 1] on the hand-computed case: policy (-1·2 - 1.2·.5 + 0.8·1)/3 = -1.8/3, value unchanged
    (2.12/3); d policy/d logps: token 0 is unclipped, -A·ρ·w/3 = -2/3; tokens 1 and 2 are clipped, 0."""
    logps, old, adv, values, old_values, returns = _ppo_inputs()
    logps.requires_grad_()
    w = torch.tensor([[2.0, 0.5, 1.0]], dtype=F64)
    loss, m = ppo_loss(logps, old, adv, values, old_values, returns, torch.ones(1, 3), importance_weights=w)
    _close(m["policy_loss"].item(), -1.8 / 3)
    _close(m["value_loss"].item(), 2.12 / 3)
    loss.backward()
    _close(logps.grad, [[-2 / 3, 0.0, 0.0]])
    _close(values.grad, [[0.0, 0.0, -0.1 / 3]])  # the value term carries no weight
    with pytest.raises(ValueError, match=r"importance_weights has shape \(3,\)"):
        ppo_loss(logps, old, adv, values, old_values, returns, torch.ones(1, 3), importance_weights=w[0])
