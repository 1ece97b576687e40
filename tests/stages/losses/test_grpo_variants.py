"""GRPO's variants (GSPO's sequence-level ratio, delta, SAPO, CISPO, VESPO, LUSPO, the off-policy and entropy
masks, the entropy bonus, the bias-corrected KL) on tiny hand-made tensors, float64, then against TRL 1.16's own
`GRPOTrainer._compute_loss` on the same batch."""
import math
import types
from collections import defaultdict

import pytest
import torch

from stages.losses import (
    entropy_bonus,
    grpo_loss,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_importance_weights,
    vespo_weights,
)

F64 = torch.float64


def _inputs():
    """The batch of tests/stages/losses/test_rl.py: old log-probs 0, so the token ratios are the probabilities.

    ρ = [[1, 1.5, 0.5], [1, 1.5, 0.5]], A = [1, -2], mask [[1, 1, 1], [1, 0, 1]].
    """
    logps = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]], dtype=F64)).requires_grad_(True)
    return logps, torch.zeros(2, 3, dtype=F64), torch.tensor([1.0, -2.0], dtype=F64), torch.tensor([[1, 1, 1],
                                                                                                     [1, 0, 1]])


def _close(a, b, tol=1e-9):
    a = torch.as_tensor(a, dtype=F64).flatten().tolist()
    b = torch.as_tensor(b, dtype=F64).flatten().tolist()
    assert len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b, strict=True)), (a, b)


# ---------------------------------------------------------------------------------------------
# Hand-derived values
# ---------------------------------------------------------------------------------------------

def test_sequence_level_ratio_is_the_geometric_mean_and_spreads_the_gradient_evenly():
    """GSPO. Row 0: r = (0 + log 1.5 + log 0.5)/3 = log(0.75)/3, ρ0 = 0.75^(1/3) ≈ 0.9086, inside [0.8, 1.2]:
    each token costs -ρ0 (A = 1). Row 1 (mask [1, 0, 1]): r = log(0.5)/2, ρ1 = √0.5 ≈ 0.7071 < 0.8 with A = -2:
    -min(-2ρ1, -2·0.8) = 1.6, clipped. grpo: (-ρ0 + 1.6)/2.

    Gradient: loss = -ρ0/2 + const, dρ0/dlogp_t = ρ0/3 on row 0's three tokens, so each gets -ρ0/6; row 1 is
    clipped (0). Token level gave row 0 unequal gradients (-1/6, 0, -0.5/6): the sequence ratio spreads it evenly.
    """
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, None, adv, mask, beta=0.0, importance_sampling_level="sequence")
    rho0 = 0.75 ** (1 / 3)
    _close(loss.item(), (-rho0 + 1.6) / 2)
    loss.backward()
    _close(logps.grad, [[-rho0 / 6] * 3, [0.0] * 3])
    _close(metrics["clip_ratio/low_mean"].item(), 2 / 5)  # row 1's two tokens: its ratio counts per token


def test_delta_caps_the_unclipped_ratio_of_a_negative_advantage():
    """ρ = 3, A = -2. Standard: -min(-2·3, -2·1.2) = 6, gradient d(2ρ)/dlogp = 2ρ = 6 (PPO never bounds a
    negative advantage's ratio). delta = 2: ρ' = min(3, 2) = 2, loss -min(-4, -2.4) = 4, gradient 0 (capped)."""
    logps = torch.tensor([[math.log(3.0)]], dtype=F64, requires_grad=True)
    old, adv, mask = torch.zeros(1, 1, dtype=F64), torch.tensor([-2.0], dtype=F64), torch.ones(1, 1)
    plain, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0)
    capped, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0, delta=2.0)
    _close([plain.item(), capped.item()], [6.0, 4.0])
    (g_plain,) = torch.autograd.grad(plain, logps)
    (g_capped,) = torch.autograd.grad(capped, logps)
    _close([g_plain.item(), g_capped.item()], [6.0, 0.0])


def test_sapo_gate_values_and_its_on_policy_slope():
    """SAPO, per token -4/τ·σ(τ(ρ - 1))·A. Row 0 (A = 1, τ = 1): -4σ(0), -4σ(0.5), -4σ(-0.5) = -2, -4σ(0.5),
    -4σ(-0.5); σ(0.5) + σ(-0.5) = 1, so the row sums to -2 - 4 = -6, mean -2. Row 1 (A = -2, τ = 1.05): tokens
    ρ = 1 and 0.5: 8/1.05·(σ(0) + σ(-0.525)), mean over 2. grpo aggregation.

    On policy (ρ = 1) the gradient is -A per token, the plain policy gradient: d/dlogp = -4/τ·σ'(0)·τ·ρ·A = -A.
    """
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, None, adv, mask, beta=0.0, loss_type="sapo")
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row1 = 8 / 1.05 * (0.5 + sig(-0.525)) / 2
    _close(loss.item(), (-2.0 + row1) / 2)
    assert "clip_ratio/region_mean" not in metrics
    on_policy = logps.detach().clone().requires_grad_(True)
    loss, _ = grpo_loss(on_policy, None, None, adv, mask, beta=0.0, loss_type="sapo")
    loss.backward()
    _close(on_policy.grad, [[-1 / 6] * 3, [2 / 4, 0.0, 2 / 4]])  # -A over (tokens · B)


def test_cispo_weights_log_pi_by_the_capped_detached_ratio():
    """CISPO with ε_h = 1.2: per token -min(ρ, 1.2)·A·logp. Row 0 (A = 1): -(1·0 + 1.2·log 1.5 + 0.5·log 0.5);
    row 1 (A = -2, tokens 0 and 2): 2·(0 + 0.5·log 0.5). dapo over the 5 tokens. Gradient -sg(w)·A/5:
    row 0 [-1, -1.2, -0.5]/5, row 1 [2, 0, 1]/5: the capped token keeps its gradient (the ratio is a weight)."""
    logps, old, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, old, None, adv, mask, beta=0.0, loss_type="cispo", epsilon_high=1.2)
    total = -(1.2 * math.log(1.5) + 0.5 * math.log(0.5)) + 2 * 0.5 * math.log(0.5)
    _close(loss.item(), total / 5)
    loss.backward()
    _close(logps.grad, [[-1 / 5, -1.2 / 5, -0.5 / 5], [2 / 5, 0.0, 1 / 5]])
    _close(metrics["cispo_clip_ratio"].item(), 1 / 5)  # row 0's ρ = 1.5 > 1.2 with A > 0


def test_vespo_gamma_weight():
    """φ(w) = e^λ·w^k·e^(-λw). w = 1: log φ = λ - λ = 0, φ = 1 for either sign. w = 2 (log w = log 2 summed from
    two tokens of log √2), A >= 0 (k 2, λ 3): log φ = 3 + 2 log 2 - 6, φ = 4e^-3; A < 0 (k 3, λ 2): φ = 8e^-2.
    A sampler weight of 0.5 on one token halves w back to 1: φ = 1."""
    log_ratio = torch.tensor([[0.0, 0.0], [0.5 * math.log(2)] * 2, [0.5 * math.log(2)] * 2], dtype=F64)
    mask = torch.ones(3, 2, dtype=F64)
    phi = vespo_weights(torch.tensor([1.0, 1.0, -1.0], dtype=F64), log_ratio, mask)
    _close(phi, [1.0, 4 * math.exp(-3), 8 * math.exp(-2)])
    halved = torch.tensor([[1.0, 1.0], [0.5, 1.0], [1.0, 1.0]], dtype=F64)
    _close(vespo_weights(torch.ones(3, dtype=F64), log_ratio, mask, halved)[1].item(), 1.0)


def test_vespo_loss_is_reinforce_weighted_by_phi():
    """On policy φ = 1, so vespo = -Σ A·logp / tokens: row 0 -(0 + log 1.5 + log 0.5), row 1 2·(0 + log 0.5),
    over 5 tokens; the gradient is -A/5 per token."""
    logps, _, adv, mask = _inputs()
    loss, metrics = grpo_loss(logps, None, None, adv, mask, beta=0.0, loss_type="vespo")
    _close(loss.item(), (-(math.log(1.5) + math.log(0.5)) + 2 * math.log(0.5)) / 5)
    _close(metrics["vespo/phi_seq_mean"].item(), 1.0)
    loss.backward()
    _close(logps.grad, [[-1 / 5] * 3, [2 / 5, 0.0, 2 / 5]])


def test_luspo_sums_each_sequence():
    """luspo: per-sequence sums, averaged: row 0 -(1 + 1.2 + 0.5) = -2.7, row 1 2·(1 + 0.8) = 3.6; (−2.7 + 3.6)/2."""
    logps, old, adv, mask = _inputs()
    loss, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0, loss_type="luspo")
    _close(loss.item(), 0.45)


def test_off_policy_sequence_mask():
    """Drift d = mean over the mask of (sampler - policy). Row 0: A < 0, d = (0.6 + 0.2)/2 = 0.4 > 0.3: drop.
    Row 1: A < 0, d = 0.2: keep. Row 2: A > 0, d = 1: keep (only negative advantages are dropped). Row 3: A < 0,
    one NaN sampler log-prob (unknown, counts 0) and one 0.5 over 2 tokens: d = 0.25, keep; its masked 9 ignored."""
    logps = torch.zeros(4, 3, dtype=F64)
    sampler = torch.tensor([[0.6, 0.2, 0.0], [0.2, 0.2, 0.2], [1.0, 1.0, 1.0], [math.nan, 0.5, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=F64)
    keep = off_policy_sequence_mask(torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=F64), logps, sampler, mask,
                                    threshold=0.3)
    _close(keep, [0.0, 1.0, 1.0, 1.0])


def test_off_policy_mask_in_the_loss_zeroes_a_dropped_sequence():
    """Dropping row 1 leaves grpo's mean over both sequences: (-0.9 + 0)/2 (row 0's mean is -2.7/3)."""
    logps, old, adv, mask = _inputs()
    loss, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0, sequence_mask=torch.tensor([1.0, 0.0], dtype=F64))
    _close(loss.item(), -0.45)


def test_high_entropy_mask():
    """Masked entropies [1, 2, 3, 4, 6] (row 1's 5 is masked). quantile 0.4: the cut is the 0.6 quantile, at
    position 0.6·4 = 2.4 of the sorted values: 3 + 0.4·(4 - 3) = 3.4, so 4 and 6 stay. quantile 1: the cut is the
    minimum, every masked token stays; quantile 0: only the maximum. `gather` widens the pool: with another
    process's [10, 10] the 0.6 quantile of [1, 2, 3, 4, 6, 10, 10] is at 3.6: 4 + 0.6·2 = 5.2, so only 6 stays."""
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    assert high_entropy_mask(ent, mask, quantile=0.4).tolist() == [[False] * 3, [True, False, True]]
    assert high_entropy_mask(ent, mask, quantile=1.0).tolist() == mask.bool().tolist()
    assert high_entropy_mask(ent, mask, quantile=0.0).tolist() == [[False] * 3, [False, False, True]]
    wider = high_entropy_mask(ent, mask, quantile=0.4, gather=lambda v: torch.cat([v, torch.tensor([10.0] * 2)]))
    assert wider.tolist() == [[False] * 3, [False, False, True]]
    with pytest.raises(ValueError, match=r"quantile = 1.5: must be in \[0, 1\]"):
        high_entropy_mask(ent, mask, quantile=1.5)


def test_token_mask_keeps_the_loss_on_chosen_tokens_only():
    """Keeping only row 0's middle token (clipped high, cost -1.2) and row 1's first (cost 2): grpo's per-row
    means still divide by the row's whole mask: (-1.2/3 + 2/2)/2 = 0.3."""
    logps, old, adv, mask = _inputs()
    keep = torch.tensor([[0, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0, token_mask=keep)
    _close(loss.item(), 0.3)


def test_entropy_bonus():
    """Mean over the mask: (1 + 2 + 3 + 4 + 6)/5 = 3.2."""
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    _close(entropy_bonus(ent, torch.tensor([[1, 1, 1], [1, 0, 1]])).item(), 3.2)


def test_bias_corrected_kl_keeps_the_value_on_policy_but_changes_the_gradient():
    """One token on policy (ρ = 1), d = ref - logp = log 2: k3 = e^d - d - 1 = 1 - log 2 either way, with A = 0.
    Gradient of β·k3: β·(1 - e^d) = -β. Corrected, β·k3·ρ adds β·k3·dρ/dlogp = β(1 - log 2): -β·log 2."""
    logps = torch.zeros(1, 1, dtype=F64, requires_grad=True)
    ref, adv, mask = torch.full((1, 1), math.log(2), dtype=F64), torch.zeros(1, dtype=F64), torch.ones(1, 1)
    plain, _ = grpo_loss(logps, None, ref, adv, mask, beta=0.5)
    corrected, _ = grpo_loss(logps, None, ref, adv, mask, beta=0.5, use_bias_correction_kl=True)
    _close([plain.item(), corrected.item()], [0.5 * (1 - math.log(2))] * 2)
    (g_plain,) = torch.autograd.grad(plain, logps)
    (g_corrected,) = torch.autograd.grad(corrected, logps)
    _close([g_plain.item(), g_corrected.item()], [-0.5, -0.5 * math.log(2)])


@pytest.mark.parametrize("mode, bounds, expected, frac", [
    ("token_truncate", (0.6, 3.5), [[2, 0.6, 3.5], [3, 1, 1]], 2 / 5),
    ("token_mask", (0.6, 3.5), [[2, 0, 0], [3, 1, 1]], 2 / 5),
    ("token_truncate", (None, 3.5), [[2, 0.5, 3.5], [3, 1, 1]], 1 / 5),
    ("sequence_truncate", (None, 3.5), [[3.5] * 3, [3, 3, 1]], 3 / 5),
    ("sequence_mask", (None, 3.5), [[0] * 3, [3, 3, 1]], 3 / 5),
    ("sequence_mask", (3.2, None), [[4] * 3, [0, 0, 1]], 2 / 5),
])
def test_sampler_importance_weights_modes(mode, bounds, expected, frac):
    """Token ratios π/μ: row 0 [2, 0.5, 4], row 1 [3, 1, (masked: weight 1)]; per sequence, their products over
    the mask: 4 and 3. truncate clamps to [clip_min, clip_max], mask zeroes what lies outside. mean_ratio is the
    per-token mean (2 + 0.5 + 4 + 3 + 1)/5 = 2.1 in every mode; frac_capped counts the masked-in tokens whose
    weight is not their ratio."""
    sampler = torch.zeros(2, 3, dtype=F64)
    logps = torch.log(torch.tensor([[2.0, 0.5, 4.0], [3.0, 1.0, 9.0]], dtype=F64))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, metrics = sampler_importance_weights(logps, sampler, mask, mode=mode, clip_min=bounds[0],
                                                  clip_max=bounds[1])
    _close(weights, expected)
    _close([metrics["tis/mean_ratio"].item(), metrics["tis/frac_capped"].item()], [2.1, frac])


def test_sampler_importance_weights_bad_inputs():
    z, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"mode = 'seq' is not supported; choose one of \['sequence_mask'"):
        sampler_importance_weights(z, z, mask, mode="seq")
    with pytest.raises(ValueError, match="clip_min = 2, clip_max = 1: clip_min must be below clip_max"):
        sampler_importance_weights(z, z, mask, clip_min=2, clip_max=1)
    with pytest.raises(ValueError, match=r"sampler_logps\[0, 1\] = nan"):
        sampler_importance_weights(z, torch.tensor([[0.0, math.nan]]), mask)


# ---------------------------------------------------------------------------------------------
# The same batch through TRL 1.16's GRPOTrainer._compute_loss
# ---------------------------------------------------------------------------------------------

def _trl_loss(logps, old, ref, adv, mask, entropies, sampler=None, *, loss_type, level="token", beta=0.0,
              epsilon=0.2, epsilon_high=0.28, delta=None, threshold=None, quantile=1.0, bias_kl=False,
              entropy_coef=0.0, is_ratio=None):
    """TRL's `_compute_loss` with these per-token log-probs in place of the model's forward: a single-process
    `accelerate.Accelerator` and the config fields it reads; everything else is TRL's own code."""
    trl = pytest.importorskip("trl")
    from accelerate import Accelerator

    trainer_cls = trl.GRPOTrainer
    args = types.SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, sapo_temperature_pos=1.0,
                                 sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                                 vespo_lambda_neg=2.0, steps_per_generation=1, entropy_target=0.2)
    t = types.SimpleNamespace(
        args=args, accelerator=Accelerator(cpu=True), model=types.SimpleNamespace(training=True),
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon_high, off_policy_mask_threshold=threshold, top_entropy_quantile=quantile,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        current_gradient_accumulation_steps=1,
        max_completion_length=8, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _entropy_bonus_enabled=entropy_coef != 0.0, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        get_off_policy_mask=trainer_cls.get_off_policy_mask, get_gamma_weights=trainer_cls.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None))
    t.get_high_entropy_mask = types.MethodType(trainer_cls.get_high_entropy_mask, t)
    B, T = mask.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if sampler is not None:
        inputs["sampling_per_token_logps"] = sampler
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return trainer_cls._compute_loss(t, None, inputs)


def _batch(seed):
    """4 completions of 5 tokens, ratios within about e^±0.4 of 1, a ragged mask, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g, dtype=F64) * 3
    logps = (old + (torch.rand(4, 5, generator=g, dtype=F64) - 0.5) * 0.8).requires_grad_(True)
    ref = old + (torch.rand(4, 5, generator=g, dtype=F64) - 0.5) * 0.4
    sampler = old + (torch.rand(4, 5, generator=g, dtype=F64) - 0.3) * 0.6
    adv = torch.tensor([1.0, -0.5, -1.5, 1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=F64)
    entropies = torch.rand(4, 5, generator=g, dtype=F64) * 2
    return logps, old, ref, sampler, adv, mask, entropies


SEED = 20  # case i runs on batch SEED + i (fixed: some batches leave a masked case nothing to compare)
CASES = [  # (loss_type, our extra kwargs, TRL's extra kwargs)
    ("grpo", {}, {}),
    ("dapo", {"importance_sampling_level": "sequence"}, {"level": "sequence"}),
    ("grpo", {"importance_sampling_level": "sequence"}, {"level": "sequence"}),
    ("bnpo", {"delta": 1.1}, {"delta": 1.1}),
    ("sapo", {}, {}),
    ("cispo", {}, {}),
    ("vespo", {}, {}),
    ("luspo", {"importance_sampling_level": "sequence"}, {"level": "sequence"}),
    ("dr_grpo", {"beta": 0.1, "use_bias_correction_kl": True}, {"beta": 0.1, "bias_kl": True}),
    ("grpo", {"beta": 0.1}, {"beta": 0.1}),
    ("dapo", {"off_policy": 0.05}, {"threshold": 0.05}),
    ("grpo", {"quantile": 0.5, "entropy_coef": 0.3}, {"quantile": 0.5, "entropy_coef": 0.3}),
    ("grpo", {"sampler": "token_truncate"}, {}),
    ("vespo", {"sampler": "token_mask"}, {}),
    ("dapo", {"sampler": "sequence_mask", "importance_sampling_level": "sequence"}, {"level": "sequence"}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_trl_on_the_same_batch(case):
    """Loss and gradient equal TRL's (ε 0.2, ε_high 0.28, max_completion_length 8, one process, no accumulation).
    With a sampler correction both sides get the same weights (TRL computes them at generation; the mode's own
    arithmetic is tested above): the comparison is of how each loss type applies them (vespo folds them into φ)."""
    loss_type, ours, theirs = CASES[case]
    ours = dict(ours)
    logps, old, ref, sampler, adv, mask, entropies = _batch(SEED + case)
    mode = ours.pop("sampler", None)  # the vLLM correction: TRL's importance_sampling_ratio is our importance_weights
    weights = None
    if mode is not None:
        weights, _ = sampler_importance_weights(old, sampler, mask, mode=mode, clip_min=0.9, clip_max=1.2)
        theirs = {**theirs, "is_ratio": weights}
        ours["importance_weights"] = weights
    theirs_loss = _trl_loss(logps, old, ref, adv, mask, entropies, sampler if mode is None else None,
                            loss_type=loss_type, **theirs)
    (theirs_grad,) = torch.autograd.grad(theirs_loss, logps)

    threshold, quantile, coef = ours.pop("off_policy", None), ours.pop("quantile", 1.0), ours.pop("entropy_coef", 0.0)
    keep = None if threshold is None else off_policy_sequence_mask(adv, logps.detach(), sampler, mask,
                                                                   threshold=threshold)
    tokens = None if quantile == 1.0 else high_entropy_mask(entropies, mask, quantile=quantile)
    beta = ours.pop("beta", 0.0)
    loss, _ = grpo_loss(logps, old, ref if beta else None, adv, mask, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                        loss_type=loss_type, num_items_in_batch=mask.sum(), max_completion_length=8,
                        sequence_mask=keep, token_mask=tokens, **ours)
    if coef:
        loss = loss - coef * entropy_bonus(entropies, mask if tokens is None else mask * tokens)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad.abs().max() > 1e-3  # a case that tests something (the loss itself may be ~0: advantages sum to 0)
    # TRL builds SAPO's temperatures as float32 scalars (1.05 -> 1.0499999523); ours keep the inputs' float64
    tol = 1e-7 if loss_type == "sapo" else 1e-12
    _close(loss.item(), theirs_loss.item(), tol=tol)
    _close(grad, theirs_grad, tol=tol)
