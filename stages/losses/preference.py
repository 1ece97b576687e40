"""Preference losses: DPO and its pairwise variants, KTO, and the named objectives a DPO trainer combines.

An objective is a pure function with one signature:

    fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta,
       chosen_num_tokens, rejected_num_tokens, **extras) -> (losses, chosen_rewards, rejected_rewards)

    chosen_logps, rejected_logps:          (B,) SUMMED completion log-probs under the policy
    ref_chosen_logps, ref_rejected_logps:  (B,) the same under the reference; None with reference_free
    chosen_num_tokens, rejected_num_tokens: (B,) completion token counts (IPO, SimPO divide by them)
    extras:                                label_smoothing, reference_free, bco_delta, discopop_tau,
                                           f_divergence_type, f_alpha_divergence_coef (accept **extras)
    returns losses (B,) with gradient, and the implicit rewards (B,) detached, or None.

`loss_type` names one or a list (with `loss_weights`): a key of `OBJECTIVES` or a dotted path
"package.module:function" to your own, imported when the trainer starts; `preference_loss`
combines them. DPO's `beta` arrives here from the config through the trainer, and nowhere else.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from stages.losses.numerics import _check_shapes, _pick, _upcast

# ---------------------------------------------------------------------------------------------
# DPO and its pairwise variants
# ---------------------------------------------------------------------------------------------
# Every variant is a function of the two log-ratios against the reference,
#   r_c = chosen_logps - ref_chosen_logps,  r_r = rejected_logps - ref_rejected_logps,
# since the DPO margin is Δ = (chosen - rejected) - (ref_chosen - ref_rejected) = r_c - r_r.
# Each takes (r_c, r_r, beta, eps, bco_delta, tau) and returns the per-pair losses (B,); with an f-divergence
# other than reverse KL, r_c and r_r arrive as their scores f'(exp r) (F_DIVERGENCES).

def _dpo_sigmoid(rc, rr, beta, eps, bco_delta, tau):
    # -(1-ε)·log σ(βΔ) - ε·log σ(-βΔ): the DPO paper; ε > 0 is conservative DPO (labels flipped w.p. ε).
    z = beta * (rc - rr)
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _dpo_hinge(rc, rr, beta, eps, bco_delta, tau):
    # relu(1 - βΔ): SLiC's hinge on the margin.
    return torch.relu(1 - beta * (rc - rr))


def _dpo_ipo(rc, rr, beta, eps, bco_delta, tau):
    # (Δ - 1/(2β))²: IPO regresses the margin onto a fixed target instead of pushing it to infinity.
    return (rc - rr - 1 / (2 * beta)) ** 2


def _dpo_robust(rc, rr, beta, eps, bco_delta, tau):
    # [-(1-ε)·log σ(βΔ) + ε·log σ(-βΔ)] / (1 - 2ε): rDPO, unbiased under label noise of rate ε.
    z = beta * (rc - rr)
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _dpo_kto_pair(rc, rr, beta, eps, bco_delta, tau):
    # KTO on the pairs: chosen as desirable, rejected as undesirable, each measured against the
    # batch KL estimate of the other half, clamped at 0 and detached (no gradient through the
    # reference point). Half of each term, so losses.mean() is the mean over the 2B examples.
    kl_c = rc.mean().clamp(min=0).detach()
    kl_r = rr.mean().clamp(min=0).detach()
    return 0.5 * ((1 - torch.sigmoid(beta * (rc - kl_r))) + (1 - torch.sigmoid(beta * (kl_c - rr))))


def _dpo_bco_pair(rc, rr, beta, eps, bco_delta, tau):
    # BCO: binary classification of β·r_c as "good" and β·r_r as "bad" around a reward shift δ:
    # -log σ(β r_c - δ) - log σ(-(β r_r - δ)). δ is a moving average of the rewards over training
    # (stages.trainers.reward_mean), state this pure function cannot keep: the caller passes it.
    if bco_delta is None:
        raise ValueError("loss_type 'bco_pair' needs bco_delta, the running mean of the implicit rewards over "
                         "training (stages.trainers.reward_mean.RewardMean); for one batch alone pass its mean")
    return -F.logsigmoid(beta * rc - bco_delta) - F.logsigmoid(-(beta * rr - bco_delta))


def _dpo_sppo_hard(rc, rr, beta, eps, bco_delta, tau):
    # SPPO with hard win/loss labels: (r_c - 1/(2β))² + (r_r + 1/(2β))².
    return (rc - 1 / (2 * beta)) ** 2 + (rr + 1 / (2 * beta)) ** 2


def _dpo_nca_pair(rc, rr, beta, eps, bco_delta, tau):
    # NCA: -log σ(β r_c) - ½·[log σ(-β r_c) + log σ(-β r_r)]; absolute likelihoods, not only the margin.
    return -F.logsigmoid(beta * rc) - 0.5 * (F.logsigmoid(-beta * rc) + F.logsigmoid(-beta * rr))


def _dpo_apo_zero(rc, rr, beta, eps, bco_delta, tau):
    # APO-zero: (1 - σ(β r_c)) + σ(β r_r): raise the chosen, lower the rejected likelihood.
    return (1 - torch.sigmoid(beta * rc)) + torch.sigmoid(beta * rr)


def _dpo_apo_down(rc, rr, beta, eps, bco_delta, tau):
    # APO-down: σ(β r_c) + (1 - σ(β(r_c - r_r))): lower both, the rejected more than the chosen.
    return torch.sigmoid(beta * rc) + (1 - torch.sigmoid(beta * (rc - rr)))


def _dpo_discopop(rc, rr, beta, eps, bco_delta, tau):
    # DiscoPOP: with z = βΔ and the mix m = σ(z/τ), (1 - m)·(-log σ(z)) + m·exp(-z): logistic for pairs the
    # policy gets wrong, exponential for those it already ranks right.
    z = beta * (rc - rr)
    mix = torch.sigmoid(z / tau)
    return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)


DPO_LOSSES = {
    "sigmoid": _dpo_sigmoid,
    "hinge": _dpo_hinge,
    "ipo": _dpo_ipo,
    "robust": _dpo_robust,
    "kto_pair": _dpo_kto_pair,
    "bco_pair": _dpo_bco_pair,
    "sppo_hard": _dpo_sppo_hard,
    "nca_pair": _dpo_nca_pair,
    "apo_zero": _dpo_apo_zero,
    "apo_down": _dpo_apo_down,
    "discopop": _dpo_discopop,
}


# f-DPO (arXiv:2309.16240): the divergence to the reference sets how a log-ratio x = log(π/π_ref) is scored,
# f'(e^x); reverse KL, DPO's own, scores it as x. α-divergence's exponent is clamped at 80 so that exp stays finite.
def _alpha_divergence(x: torch.Tensor, alpha: float) -> torch.Tensor:
    if abs(alpha - 1.0) < 1e-6:  # the limit α -> 1 is reverse KL
        return x
    return (torch.exp(((alpha - 1.0) * x).clamp(max=80.0)) - 1.0) / (alpha - 1.0)


F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda x, alpha: x,
    "forward_kl": lambda x, alpha: 1 - torch.exp(-x),
    "js_divergence": lambda x, alpha: math.log(2) + F.logsigmoid(x),
    "alpha_divergence": _alpha_divergence,
}
F_DIVERGENCE_LOSSES = ("sigmoid", "hinge", "robust", "discopop")  # the variants that score the margin only


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None, *,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             reference_free: bool = False, bco_delta: float | torch.Tensor | None = None,
             discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses from sequence log-probs.

    chosen_logps, rejected_logps: (B,) summed log-probs of each response under the policy
    (length-averaged for "ipo"); ref_chosen_logps, ref_rejected_logps: (B,) the same under the
    frozen reference. With r_c = chosen_logps - ref_chosen_logps, r_r = rejected_logps -
    ref_rejected_logps and the margin Δ = r_c - r_r, β = beta, ε = label_smoothing:

      sigmoid    -(1-ε)·log σ(βΔ) - ε·log σ(-βΔ)                 DPO; ε > 0: conservative DPO
      hinge      relu(1 - βΔ)                                    SLiC
      ipo        (Δ - 1/(2β))²                                   IPO
      robust     [-(1-ε)·log σ(βΔ) + ε·log σ(-βΔ)] / (1 - 2ε)    robust DPO
      kto_pair   ½·[(1 - σ(β(r_c - KL_r))) + (1 - σ(β(KL_c - r_r)))],
                 KL_c = max(0, mean(r_c)), KL_r = max(0, mean(r_r)), both detached
      bco_pair   -log σ(β r_c - δ) - log σ(-(β r_r - δ)), δ = bco_delta (required): the running
                 mean of the implicit rewards over training, kept by the trainer
      sppo_hard  (r_c - 1/(2β))² + (r_r + 1/(2β))²
      nca_pair   -log σ(β r_c) - ½·[log σ(-β r_c) + log σ(-β r_r)]
      apo_zero   (1 - σ(β r_c)) + σ(β r_r)
      apo_down   σ(β r_c) + (1 - σ(β(r_c - r_r)))
      discopop   (1 - m)·(-log σ(βΔ)) + m·exp(-βΔ),  m = σ(βΔ/τ), τ = discopop_tau

    f_divergence_type (f-DPO): r_c and r_r are replaced by their scores f'(exp r) before the
    variant, for the variants in F_DIVERGENCE_LOSSES: reverse_kl r (DPO), forward_kl 1 - e^(-r),
    js_divergence log 2 + log σ(r), alpha_divergence (e^((α-1) r) - 1)/(α-1) with α =
    f_alpha_divergence_coef. The implicit rewards stay β·r.

    reference_free=True takes the reference log-probs as 0 everywhere (the reference
    arguments may then be None): r_c = chosen_logps, r_r = rejected_logps.

    Returns (losses, chosen_rewards, rejected_rewards), each (B,); the rewards are the
    implicit rewards β·r_c and β·r_r, detached. Half-precision inputs are computed in float32.
    """
    if chosen_logps.dim() != 1:
        raise ValueError(f"chosen_logps has shape {tuple(chosen_logps.shape)}: expected (B,), one log-prob per pair")
    if not reference_free and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError("ref_chosen_logps and ref_rejected_logps are required unless reference_free=True")
    _check_shapes(chosen_logps.shape, "chosen_logps", rejected_logps=rejected_logps,
                  ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if not beta > 0:
        raise ValueError(f"beta = {beta}: must be > 0 (the KL strength; 0.1 is typical)")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing = {label_smoothing}: must be in [0, 0.5) (the assumed label-flip rate)")
    fn = _pick(DPO_LOSSES, loss_type, "loss_type")
    score = _pick(F_DIVERGENCES, f_divergence_type, "f_divergence_type")
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSSES:
        raise ValueError(f"f_divergence_type = {f_divergence_type!r} applies to loss_type "
                         f"{', '.join(F_DIVERGENCE_LOSSES)}; got loss_type {loss_type!r}: use reverse_kl with it")
    if not discopop_tau > 0:
        raise ValueError(f"discopop_tau = {discopop_tau}: must be > 0 (the temperature of DiscoPOP's blend)")

    chosen, rejected = _upcast(chosen_logps), _upcast(rejected_logps)
    if reference_free:
        rc, rr = chosen, rejected
    else:
        rc, rr = chosen - _upcast(ref_chosen_logps), rejected - _upcast(ref_rejected_logps)
    losses = fn(score(rc, f_alpha_divergence_coef), score(rr, f_alpha_divergence_coef), beta, label_smoothing,
                bco_delta, discopop_tau)
    return losses, (beta * rc).detach(), (beta * rr).detach()


# ---------------------------------------------------------------------------------------------
# KTO (unpaired)
# ---------------------------------------------------------------------------------------------

def _kto(r, z, beta):
    # KTO: desirable 1 - σ(β(r - z)), undesirable 1 - σ(β(z - r)), around the reference point z.
    return 1 - torch.sigmoid(beta * (r - z)), 1 - torch.sigmoid(beta * (z - r))


def _apo_zero_unpaired(r, z, beta):
    # APO-zero on unpaired rows: desirable 1 - σ(β r), undesirable σ(β r); no reference point.
    return 1 - torch.sigmoid(beta * r), torch.sigmoid(beta * r)


# loss_type -> (r, z, beta) -> (desirable losses, undesirable losses), each (B,)
KTO_LOSSES = {"kto": _kto, "apo_zero_unpaired": _apo_zero_unpaired}
KTO_LOSSES_WITH_KL = ("kto",)  # the variants that use the KL reference point (the others need no KL estimate)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, kl: torch.Tensor | float,
             labels: torch.Tensor, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, loss_type: str = "kto") -> torch.Tensor:
    """KTO's per-example losses for unpaired desirable / undesirable completions.

    policy_logps, ref_logps: (B,) summed completion log-probs; labels: (B,) bool, True for a
    desirable completion; kl: scalar, the batch estimate of KL(policy || reference) (from
    mismatched prompt/completion pairs), used as the reference point z = max(0, kl), detached.
    With r = policy_logps - ref_logps:

      loss_type          desirable                            undesirable
      kto                w_d · (1 - σ(β(r - z)))             w_u · (1 - σ(β(z - r)))
      apo_zero_unpaired  w_d · (1 - σ(β r))                  w_u · σ(β r)          (kl unused)

    w_d = desirable_weight, w_u = undesirable_weight. Returns losses (B,); the trainer averages them.
    """
    if policy_logps.dim() != 1:
        raise ValueError(f"policy_logps has shape {tuple(policy_logps.shape)}: expected (B,)")
    _check_shapes(policy_logps.shape, "policy_logps", ref_logps=ref_logps, labels=labels)
    if not beta > 0:
        raise ValueError(f"beta = {beta}: must be > 0 (the KL strength; 0.1 is typical)")
    fn = _pick(KTO_LOSSES, loss_type, "loss_type")
    r = _upcast(policy_logps) - _upcast(ref_logps)
    z = torch.as_tensor(kl, dtype=r.dtype, device=r.device).detach().clamp(min=0)
    desirable, undesirable = fn(r, z, beta)
    return torch.where(labels.bool(), desirable_weight * desirable, undesirable_weight * undesirable)


# ---------------------------------------------------------------------------------------------
# Named objectives and their weighted sum (what DPOTrainer and OnlineDPOTrainer call)
# ---------------------------------------------------------------------------------------------

Objective = Callable[..., tuple]


def _dpo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, loss_type,
         chosen_num_tokens, rejected_num_tokens, label_smoothing=0.0, reference_free=False, bco_delta=None,
         discopop_tau=0.05, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, **_):
    if loss_type == "ipo":  # IPO works on length-averaged log-probs (the IPO paper), for both models
        n_c, n_r = chosen_num_tokens.clamp(min=1), rejected_num_tokens.clamp(min=1)
        chosen_logps, rejected_logps = chosen_logps / n_c, rejected_logps / n_r
        if not reference_free:
            ref_chosen_logps, ref_rejected_logps = ref_chosen_logps / n_c, ref_rejected_logps / n_r
    return dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta,
                    loss_type=loss_type, label_smoothing=label_smoothing, reference_free=reference_free,
                    bco_delta=bco_delta, discopop_tau=discopop_tau, f_divergence_type=f_divergence_type,
                    f_alpha_divergence_coef=f_alpha_divergence_coef)


def sft_objective(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, chosen_num_tokens, **_):
    """Negative log-likelihood of the chosen completion, mean per token of each pair: (B,); no rewards."""
    return -chosen_logps / chosen_num_tokens.clamp(min=1), None, None


OBJECTIVES: dict[str, Objective] = {**{name: partial(_dpo, loss_type=name) for name in DPO_LOSSES},
                                    "sft": sft_objective}


def resolve_objective(name: str) -> Objective:
    """An `OBJECTIVES` key, or "module:function" imported from user code; ValueError saying what to fix."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(f"{name!r}: neither a built-in objective ({', '.join(OBJECTIVES)}) nor a dotted import "
                         "path 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name!r}: cannot import {attr!r} from {module!r} ({e}); is the module on PYTHONPATH?"
                         ) from e
    if not callable(fn):
        raise ValueError(f"{name!r} is a {type(fn).__name__}, not a function")
    return fn


def check_objective_output(name: str, out, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                        torch.Tensor | None]:
    """Validate what an objective returned: (losses (B,), rewards (B,) or None, rewards (B,) or None)."""
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"objective {name!r} must return (losses, chosen_rewards, rejected_rewards), "
                         f"got {type(out).__name__}")
    losses = out[0]
    if not (isinstance(losses, torch.Tensor) and losses.shape == (batch_size,)):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"objective {name!r} returned losses of shape {shape}: expected ({batch_size},), one loss "
                         "per pair (do not reduce; the trainer weights and averages)")
    return out


def objective_problems(loss_type: str | list[str]) -> list[tuple[str, str]]:
    """Each objective named in `loss_type` is known or imports (user code, by dotted path)."""
    problems = []
    for i, name in enumerate([loss_type] if isinstance(loss_type, str) else loss_type):
        key = "loss_type" if isinstance(loss_type, str) else f"loss_type[{i}]"
        if name in OBJECTIVES:
            continue
        if ":" not in name:
            problems.append((key, f"= {name!r}: supported: {', '.join(OBJECTIVES)}, or a dotted import path "
                             "'package.module:function'"))
            continue
        try:
            resolve_objective(name)
        except ValueError as e:
            problems.append((key, f"= {e}"))
    return problems


def preference_loss(objectives: list[tuple[str, Callable]], loss_weights: list[float], logps: torch.Tensor,
                    num_tokens: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None, *,
                    weight: torch.Tensor | None = None, beta: float, label_smoothing: float = 0.0,
                    reference_free: bool = False, bco_delta: float | None = None, discopop_tau: float = 0.05,
                    f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of the objectives per pair, times the pair weights, averaged over pairs.

    logps, num_tokens: (2B,) summed completion log-probs and token counts, chosen rows first;
    ref_chosen, ref_rejected: (B,) summed reference log-probs (None with reference_free);
    weight: (B,) per-pair loss scale or None; bco_delta: bco_pair's running reward mean
    (`stages.trainers.reward_mean`); discopop_tau, f_divergence_type, f_alpha_divergence_coef: see
    `dpo_loss`. Returns (loss, per-pair metrics (B,), detached):
    the implicit rewards of the first objective that has them, logps, and "loss/<name>" per
    objective when there are several.
    """
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = num_tokens.chunk(2)
    total, rewards, stats = 0.0, None, {}
    for (name, fn), w in zip(objectives, loss_weights, strict=True):
        out = fn(chosen, rejected, ref_chosen, ref_rejected, beta=beta, chosen_num_tokens=n_chosen,
                 rejected_num_tokens=n_rejected, label_smoothing=label_smoothing, reference_free=reference_free,
                 bco_delta=bco_delta, discopop_tau=discopop_tau, f_divergence_type=f_divergence_type,
                 f_alpha_divergence_coef=f_alpha_divergence_coef)
        losses, chosen_rewards, rejected_rewards = check_objective_output(name, out, chosen.shape[0])
        total = total + w * losses
        if len(objectives) > 1:
            stats[f"loss/{name}"] = losses.detach()
        if rewards is None and chosen_rewards is not None:
            rewards = (chosen_rewards.detach(), rejected_rewards.detach())
    if weight is not None:
        total = total * weight.to(total.dtype)
    if rewards is not None:
        c, r = rewards
        stats.update({"rewards/chosen": c, "rewards/rejected": r, "rewards/accuracies": (c > r).float(),
                      "rewards/margins": c - r})
    stats.update({"logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()})
    return total.mean(), stats
