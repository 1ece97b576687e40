"""Online RL losses: per-token KL estimators, GRPO's advantages and loss variants, PPO with GAE."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stages.losses.numerics import _check_shapes, _masked_mean, _pick, _upcast

# ---------------------------------------------------------------------------------------------
# Per-token KL estimators (GRPO's penalty, PPO's per-token rewards)
# ---------------------------------------------------------------------------------------------

def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k1 = log π(x) - log π_ref(x) per sampled token: unbiased for KL(π || π_ref), but can be < 0.

    logps, ref_logps: same shape (e.g. (B, T)). Schulman, "Approximating KL Divergence" (2020).
    """
    return logps - ref_logps


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r with r = π_ref(x) / π(x), i.e. exp(d) - 1 - d for d = ref_logps - logps.

    Unbiased for KL(π || π_ref) and never < 0 (exp(d) >= 1 + d); exactly 0 where the two agree.
    expm1 keeps it accurate for small d. Same shapes as `kl_k1`.
    """
    d = ref_logps - logps
    return torch.expm1(d) - d


KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------

_GRPO_EPS = 1e-4


def _masked_std(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unbiased (n - 1) std along dim 1 over the entries where `valid`, keepdim; 0 with fewer than 2."""
    n = valid.sum(dim=1, keepdim=True)
    mean = torch.where(valid, x, 0).sum(dim=1, keepdim=True) / n.clamp(min=1)
    var = torch.where(valid, (x - mean) ** 2, 0).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    return var.sqrt()


GRPO_REWARD_SCALES = {
    # (rewards (G_count, G) grouped, valid (G_count, G) bool) -> divisor broadcastable to that shape.
    "group": lambda grouped, valid: _masked_std(grouped, valid) + _GRPO_EPS,
    "batch": lambda grouped, valid: _masked_std(grouped.reshape(1, -1), valid.reshape(1, -1)) + _GRPO_EPS,
    "none": lambda grouped, valid: torch.ones((), dtype=grouped.dtype, device=grouped.device),
}


@torch.no_grad()
def grpo_advantages(rewards: torch.Tensor, num_generations: int, *, scale_rewards: str = "group",
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-relative advantages: each reward minus the mean of its group, optionally scaled.

    rewards: (B·G,), where each consecutive run of G = num_generations entries holds the
    completions of one prompt. A_i = r_i - mean(group(i)), then divided by

      group  std(group(i)) + 1e-4      GRPO
      batch  std(all B·G rewards) + 1e-4
      none   1                         Dr. GRPO (no difficulty bias from the std)

    std is the unbiased (n - 1) sample standard deviation, as torch.std by default; a group
    of equal rewards gets advantage 0. valid: (B·G,) bool, False for unscored completions
    (a reward function returned None; their `rewards` entry is ignored, NaN allowed): they
    get advantage 0 and are left out of every mean and std, so a group's baseline is the
    mean of its scored completions (a group with one scored completion: advantage 0).
    Returns advantages (B·G,), detached.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: expected (B·G,), one reward per completion")
    if num_generations < 2:
        raise ValueError(f"num_generations = {num_generations}: must be >= 2 (one completion has no group baseline)")
    if rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} entries, not divisible by num_generations = "
                         f"{num_generations}: expected B·G, G completions for each prompt")
    if valid is not None:
        _check_shapes(rewards.shape, "rewards", valid=valid)
    scale = _pick(GRPO_REWARD_SCALES, scale_rewards, "scale_rewards")
    grouped = _upcast(rewards).view(-1, num_generations)
    ok = torch.ones_like(grouped, dtype=torch.bool) if valid is None else valid.bool().view(-1, num_generations)
    grouped = torch.where(ok, grouped, 0)  # NaN placeholders must not leak through 0 * NaN
    mean = grouped.sum(dim=1, keepdim=True) / ok.sum(dim=1, keepdim=True).clamp(min=1)
    advantages = torch.where(ok, (grouped - mean) / scale(grouped, ok), 0)
    return advantages.reshape(-1)


@torch.no_grad()
def normalized_sum_advantages(rewards: torch.Tensor, weights: torch.Tensor, num_generations: int, *,
                              valid: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages from several reward functions normalised one by one, then summed (TRL's normalize_then_sum, GDPO).

    rewards: (B·G, K), one column per reward function, NaN where a function gave no score; weights: (K,);
    each consecutive run of G = num_generations rows is one prompt's group. Per function k and group,
    z_k = (r_k - mean) / (std + 1e-4) over the group's scored entries; then s = Σ_k w_k·z_k (a NaN z_k
    counts 0), and the advantage is (s - mean(s)) / (std(s) + 1e-4) over the whole batch's valid rows.
    std is the unbiased (n - 1) one, 0 with fewer than 2 entries. valid: (B·G,) bool, False for rows that
    get advantage 0 and stay out of the batch statistics (default: rows with at least one score).
    Unlike summing first, a function with a wide reward range cannot drown the others within a group.
    Returns (B·G,), detached.
    """
    if rewards.dim() != 2 or weights.shape != rewards.shape[1:]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} and weights {tuple(weights.shape)}: expected "
                         "(B·G, K) and (K,), one column and one weight per reward function")
    if num_generations < 2 or rewards.shape[0] % num_generations:
        raise ValueError(f"{rewards.shape[0]} rows and num_generations = {num_generations}: expected >= 2 "
                         "completions per prompt and a whole number of groups")
    rewards = _upcast(rewards)
    scored = torch.isfinite(rewards)
    valid = scored.any(dim=1) if valid is None else valid.bool() & scored.any(dim=1)
    n, k = rewards.shape
    grouped = rewards.view(-1, num_generations, k).transpose(1, 2).reshape(-1, num_generations)
    ok = scored.view(-1, num_generations, k).transpose(1, 2).reshape(-1, num_generations)
    clean = torch.where(ok, grouped, 0)
    mean = clean.sum(dim=1, keepdim=True) / ok.sum(dim=1, keepdim=True).clamp(min=1)
    z = torch.where(ok, (clean - mean) / (_masked_std(clean, ok) + _GRPO_EPS), 0)
    z = z.view(-1, k, num_generations).transpose(1, 2).reshape(n, k)
    total = (z * _upcast(weights)).sum(dim=1)
    row = valid.view(1, -1)
    batch = torch.where(row, total.view(1, -1), 0)
    batch_mean = batch.sum() / row.sum().clamp(min=1)
    out = torch.where(row, (batch - batch_mean) / (_masked_std(batch, row) + _GRPO_EPS), 0)
    return out.view(-1)


GRPO_AGGREGATIONS = {
    # loss_type -> (per_token (B, T), mask (B, T), num_items_in_batch, max_completion_length) -> scalar
    "grpo": lambda x, m, n, L: ((x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).mean(),
    "bnpo": lambda x, m, n, L: (x * m).sum() / m.sum().clamp(min=1),
    # Dr. GRPO: a constant denominator, so neither a completion's length nor the batch's padding weights a token.
    "dr_grpo": lambda x, m, n, L: (x * m).sum() / (x.shape[0] * L),
    "dapo": lambda x, m, n, L: (x * m).sum() / (n if n is not None else m.sum().clamp(min=1)),
    # LUSPO: each sequence's summed token losses, averaged over sequences (long completions weigh more).
    "luspo": lambda x, m, n, L: (x * m).sum(dim=1).mean(),
}
GRPO_AGGREGATIONS["sapo"] = GRPO_AGGREGATIONS["grpo"]
GRPO_AGGREGATIONS["cispo"] = GRPO_AGGREGATIONS["vespo"] = GRPO_AGGREGATIONS["dapo"]


def _clipped_term(ratio, adv, logps, log_ratio, mask, p):
    """PPO's clipped surrogate; delta caps the unclipped ratio too (INTELLECT-2's two-sided clip)."""
    clipped = torch.clamp(ratio, 1 - p["epsilon_low"], 1 + p["epsilon_high"])
    if p["delta"] is not None:
        ratio = ratio.clamp(max=p["delta"])
    return -torch.min(ratio * adv, clipped * adv)


def _sapo_term(ratio, adv, logps, log_ratio, mask, p):
    """SAPO: a smooth gate 4/τ·σ(τ(ρ - 1)) in place of the hard clip (slope 1 at ρ = 1), τ by the advantage's sign."""
    tau = torch.where(adv > 0, adv.new_tensor(p["sapo_temperature_pos"]), adv.new_tensor(p["sapo_temperature_neg"]))
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


def _cispo_term(ratio, adv, logps, log_ratio, mask, p):
    """CISPO: REINFORCE on log π weighted by the detached ratio, capped at epsilon_high (no token loses its grad)."""
    return -torch.clamp(ratio, max=p["epsilon_high"]).detach() * adv * logps


def _vespo_term(ratio, adv, logps, log_ratio, mask, p):
    """VESPO: REINFORCE on log π weighted by the detached gamma weight φ of the sequence's ratio (`vespo_weights`)."""
    phi = vespo_weights(adv.squeeze(1), log_ratio, mask, p["importance_weights"], k_pos=p["vespo_k_pos"],
                        lambda_pos=p["vespo_lambda_pos"], k_neg=p["vespo_k_neg"], lambda_neg=p["vespo_lambda_neg"])
    return -phi.unsqueeze(1) * adv * logps


GRPO_POLICY_TERMS = {
    # loss_type -> per-token policy term (ratio (B, T), adv (B, 1), logps, log_ratio, mask, params) -> (B, T)
    "grpo": _clipped_term, "bnpo": _clipped_term, "dr_grpo": _clipped_term, "dapo": _clipped_term,
    "luspo": _clipped_term, "sapo": _sapo_term, "cispo": _cispo_term, "vespo": _vespo_term,
}


def _sequence_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio: the mean of the token log-ratios over each row's mask, broadcast to (B, T)."""
    per_row = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return per_row.expand_as(log_ratio)


IMPORTANCE_SAMPLING_LEVELS = {
    # (token log-ratios (B, T), mask (B, T)) -> the log-ratios the loss uses, (B, T)
    "token": lambda log_ratio, mask: log_ratio,
    "sequence": _sequence_mean_log_ratio,
}


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  importance_weights: torch.Tensor | None = None, *, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's gamma weights φ(w) = e^λ · w^k · e^(-λw) (so φ(1) = 1) of each sequence's importance ratio w.

    advantages: (B,); log_ratio: (B, T) log π - log π_old per token; mask: (B, T); importance_weights:
    (B, T) or None, a sampler correction (π_old / μ) folded into w. In log space, with each term
    clamped to [log 1e-8, 20] (token log-ratios first to [-20, 20]):

      log w = Σ_t mask·log_ratio + Σ_t log importance_weights,   log φ = λ + k·log w - λ·w

    (k, λ) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg). Returns φ (B,), detached:
    it scales the gradient only; NaN or infinite φ become 0.
    """
    lower = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=1)
    if importance_weights is not None:
        log_w = log_w + torch.log(importance_weights).clamp(lower, 20.0).sum(dim=1)
    log_w = log_w.clamp(lower, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
    lam = torch.where(positive, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_sequence_mask(advantages: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor,
                             mask: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: drop a sequence whose advantage is negative and whose sampler
    has drifted from the policy by more than `threshold`.

    advantages: (B,); logps: (B, T) the policy now; sampler_logps: (B, T) the log-probs it was sampled with
    (NaN: unknown, counted as no drift); mask: (B, T). Per row, d = mean over the mask of
    (sampler_logps - logps), an estimate of KL(μ || π); keep = A >= 0 or d <= threshold.
    Returns (B,) floats, 1 keep, 0 drop; detached.
    """
    drift = torch.nan_to_num(sampler_logps - logps, nan=0.0)
    mean_drift = (drift * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return ((advantages >= 0) | (mean_drift <= threshold)).to(logps.dtype)


@torch.no_grad()
def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, *, quantile: float,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The tokens in the top `quantile` share by entropy ("Beyond the 80/20 rule"), for the policy loss only.

    entropies, mask: (B, T). The cut is torch.quantile (linear interpolation) at 1 - quantile of the
    masked entropies; a token is kept when its entropy >= the cut. quantile 1 keeps every masked
    token, 0 only the highest. gather: joins the masked entropies of every process (1-D, any lengths)
    so the cut is the whole batch's; None: this batch alone. Returns (B, T) bool, False off the mask.
    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile = {quantile}: must be in [0, 1] (the share of tokens kept; 0.2 in the paper)")
    on = mask.bool()
    values = entropies[on].float()
    values = gather(values) if gather is not None else values
    if values.numel() == 0:
        return torch.zeros_like(on)
    cut = torch.quantile(values, 1 - quantile)
    return (entropies >= cut.to(entropies.dtype)) & on


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy over the masked tokens: the loss subtracts entropy_coef times it. entropies, mask: (B, T)."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def truncated_importance_weights(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, *,
                                 cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token truncated importance sampling (TIS) weights for samples drawn by another sampler.

    logps: (B, T) the policy's log-probs of the sampled tokens at sampling time (detached: the weights
    carry no gradient); sampler_logps: (B, T) the log-probs the sampler drew them with (a vLLM server,
    a stale copy); mask: (B, T), 1 on the tokens that count. Per token

      w = min(exp(logps - sampler_logps), cap)

    so E_sampler[w · f] = E_policy[f] for each token while no ratio exceeds `cap`; the cap trades
    that bias for bounded variance. Masked tokens get w = 1. cap must be >= 1 (a cap below 1 would
    down-weight on-policy tokens, whose ratio is 1). `sampler_importance_weights` in mode token_truncate.

    Returns (weights (B, T), metrics): "tis/mean_ratio", the mean uncapped ratio over the masked
    tokens, and "tis/frac_capped", the share of them whose ratio exceeded the cap.
    """
    if not cap >= 1:
        raise ValueError(f"cap = {cap}: must be >= 1 (the largest importance weight; 2.0 is typical)")
    return sampler_importance_weights(logps, sampler_logps, mask, mode="token_truncate", clip_max=cap)


def _truncate(ratio, lo, hi):
    return ratio.clamp(min=lo, max=hi)


def _mask_outside(ratio, lo, hi):
    return torch.where((ratio < lo) | (ratio > hi), 0.0, ratio)


IMPORTANCE_SAMPLING_MODES = {
    # mode -> (one ratio per sequence?, (ratio, lo, hi) -> weight)
    "token_truncate": (False, _truncate), "token_mask": (False, _mask_outside),
    "sequence_truncate": (True, _truncate), "sequence_mask": (True, _mask_outside),
}


@torch.no_grad()
def sampler_importance_weights(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, *,
                               mode: str = "token_truncate", clip_min: float | None = None,
                               clip_max: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights π/μ for samples another sampler μ drew, bounded as TRL's vllm_importance_sampling_mode.

    logps: (B, T) the policy's log-probs of the sampled tokens at sampling time; sampler_logps: (B, T) the
    sampler's; mask: (B, T). The ratio is exp(logps - sampler_logps) per token (token_*), or exp of its sum
    over the row's mask, one per sequence, on every token of it (sequence_*). Then with [lo, hi] =
    [clip_min, clip_max] (None: unbounded on that side):

      *_truncate   w = clamp(ratio, lo, hi)
      *_mask       w = ratio inside [lo, hi], else 0 (the token, or the whole sequence, drops out)

    Masked tokens get w = 1; the weights are detached. Returns (weights (B, T), metrics):
    "tis/mean_ratio", the mean per-token ratio over the masked tokens (1 on policy), and "tis/frac_capped",
    the share of them whose weight differs from their ratio (truncated or dropped).
    """
    _check_shapes(logps.shape, "logps", sampler_logps=sampler_logps, mask=mask)
    per_sequence, bound = _pick(IMPORTANCE_SAMPLING_MODES, mode, "mode")
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"clip_min = {clip_min}, clip_max = {clip_max}: clip_min must be below clip_max")
    on = mask.bool()
    bad = (~torch.isfinite(sampler_logps) & on).nonzero()
    if len(bad):
        row, col = bad[0].tolist()
        raise ValueError(f"sampler_logps[{row}, {col}] = {sampler_logps[row, col].item()}: the sampler gave no "
                         f"finite log-prob for this token ({len(bad)} such tokens); the off-policy correction "
                         "needs one per sampled token (a vLLM server must answer `logprobs`)")
    log_ratio = torch.where(on, _upcast(logps) - _upcast(sampler_logps), 0.0)
    token_ratio = torch.exp(log_ratio)
    ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True)).expand_as(log_ratio) if per_sequence else token_ratio
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    weights = torch.where(on, bound(ratio, lo, hi), 1.0)
    m = on.to(token_ratio.dtype)
    metrics = {"tis/mean_ratio": _masked_mean(token_ratio, m),
               "tis/frac_capped": _masked_mean((weights != ratio).to(m.dtype), m)}
    return weights, metrics


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon_low: float = 0.2,
              epsilon_high: float | None = None, loss_type: str = "grpo",
              num_items_in_batch: int | torch.Tensor | None = None, max_completion_length: int | None = None,
              importance_weights: torch.Tensor | None = None, importance_sampling_level: str = "token",
              delta: float | None = None, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0, sequence_mask: torch.Tensor | None = None,
              token_mask: torch.Tensor | None = None, use_bias_correction_kl: bool = False,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's policy loss and its variants, with an optional k3 KL penalty, aggregated by `loss_type`.

    logps, old_logps, ref_logps: (B, T) per-token completion log-probs under the policy, the
    policy that sampled (None: logps detached, i.e. one update per generation) and the
    reference; mask: (B, T), 1 on completion tokens; advantages: (B,), one per completion.
    The importance ratio ρ = exp(r) where, by `importance_sampling_level`,

      token     r = logps - old_logps per token
      sequence  r = the mean of those over the row's mask, one ratio per completion (GSPO)

    The per-token policy term by `loss_type` (`GRPO_POLICY_TERMS`), ε_h = epsilon_high (default epsilon_low):

      grpo, bnpo, dr_grpo, dapo, luspo   -min(ρ'·A, clip(ρ, 1 - ε_low, 1 + ε_h)·A), ρ' = min(ρ, delta)
                                         (delta None: ρ' = ρ; INTELLECT-2's two-sided clip)
      sapo    -4/τ·σ(τ(ρ - 1))·A, τ = sapo_temperature_pos where A > 0, else sapo_temperature_neg
      cispo   -sg(min(ρ, ε_h))·A·logps     (sg: no gradient through the weight)
      vespo   -φ·A·logps, φ = `vespo_weights` of the completion's summed log-ratio (and importance_weights)

    That term is multiplied by sequence_mask (B,) (`off_policy_sequence_mask`), token_mask (B, T)
    (`high_entropy_mask`) and importance_weights (B, T), detached, for samples another sampler drew
    (`truncated_importance_weights`; vespo folds them into φ instead). With β > 0 it adds β·KL,
    KL = exp(d) - d - 1, d = ref_logps - logps (`kl_k3`, >= 0), times ρ when use_bias_correction_kl
    (so the KL gradient is unbiased off-policy; ρ carries gradient, so it changes the gradient on
    policy too). Then, by `loss_type` (`GRPO_AGGREGATIONS`):

      grpo, sapo           mean over each sequence's tokens, then over the B sequences
      bnpo                 sum over all tokens / number of tokens
      dr_grpo              sum / (B·L), L = max_completion_length, the generation budget (required): a
                           constant, so padding columns or the batch's longest completion change nothing
      dapo, cispo, vespo   sum / num_items_in_batch: the loss tokens of the whole generation batch (every
                           micro-batch of the optimizer step, every process); summing the micro-batches'
                           losses gives the token mean over that batch (default: this call's own count)
      luspo                each sequence's sum, averaged over the B sequences

    Returns (loss, metrics), metrics detached, means over the masked tokens (a sequence-level ratio
    counts once per token): "clip_ratio/low_mean" (ρ < 1 - ε_low and A < 0), "clip_ratio/high_mean"
    (ρ > 1 + ε_h and A > 0), "clip_ratio/region_mean" (either) for the clipped losses; "cispo_clip_ratio"
    (ρ > ε_h, A > 0); "vespo/phi_seq_mean"; "kl" when β > 0.
    """
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}: expected (B, T)")
    _check_shapes(logps.shape, "logps", old_logps=old_logps, ref_logps=ref_logps, mask=mask,
                  importance_weights=importance_weights, token_mask=token_mask)
    _check_shapes(logps.shape[:1], "logps[:, 0]", advantages=advantages, sequence_mask=sequence_mask)
    if beta < 0:
        raise ValueError(f"beta = {beta}: must be >= 0 (the KL penalty; 0 turns it off)")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps is None but beta = {beta}: the KL penalty needs the reference log-probs")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low = {epsilon_low}, epsilon_high = {epsilon_high}: must be >= 0")
    if delta is not None and not delta > 0:
        raise ValueError(f"delta = {delta}: must be > 0 (the cap on the unclipped ratio; above 1 + epsilon_high)")
    if min(sapo_temperature_pos, sapo_temperature_neg) <= 0:
        raise ValueError(f"sapo_temperature_pos = {sapo_temperature_pos}, sapo_temperature_neg = "
                         f"{sapo_temperature_neg}: must be > 0 (the slope of SAPO's gate)")
    term = _pick(GRPO_POLICY_TERMS, loss_type, "loss_type")
    aggregate = GRPO_AGGREGATIONS[loss_type]
    level = _pick(IMPORTANCE_SAMPLING_LEVELS, importance_sampling_level, "importance_sampling_level")
    if loss_type == "dr_grpo":
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(f"max_completion_length = {max_completion_length}: loss_type 'dr_grpo' divides by the "
                             "constant B·max_completion_length; pass the generation budget (max_new_tokens)")
        longest = int(mask.sum(dim=1).max()) if mask.numel() else 0
        if longest > max_completion_length:
            raise ValueError(f"a completion has {longest} loss tokens > max_completion_length = "
                             f"{max_completion_length}: pass the budget the completions were generated with")

    logps = _upcast(logps)
    old_logps = logps.detach() if old_logps is None else _upcast(old_logps)
    mask = mask.to(logps.dtype)
    adv = _upcast(advantages).unsqueeze(1)
    weights = None if importance_weights is None else _upcast(importance_weights).detach()
    token_log_ratio = logps - old_logps
    ratio = torch.exp(level(token_log_ratio, mask))
    params = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                  sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                  vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                  vespo_lambda_neg=vespo_lambda_neg, importance_weights=weights)
    per_token = term(ratio, adv, logps, token_log_ratio, mask, params)
    if sequence_mask is not None:
        per_token = per_token * sequence_mask.detach().to(per_token.dtype).unsqueeze(1)
    if token_mask is not None:
        per_token = per_token * token_mask.detach().to(per_token.dtype)
    if weights is not None and loss_type != "vespo":
        per_token = per_token * weights
    metrics = {}
    if beta > 0:
        assert ref_logps is not None  # refused above when beta > 0
        kl = kl_k3(logps, _upcast(ref_logps))
        metrics["kl"] = _masked_mean(kl, mask).detach()
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)
    loss = aggregate(per_token, mask, num_items_in_batch, max_completion_length)

    with torch.no_grad():
        if term is _clipped_term:
            low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
            high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
            metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
            metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
            metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
        elif loss_type == "cispo":
            metrics["cispo_clip_ratio"] = _masked_mean(((ratio > epsilon_high) & (adv > 0)).to(mask.dtype), mask)
        elif loss_type == "vespo":
            phi = vespo_weights(advantages, token_log_ratio, mask, weights, k_pos=vespo_k_pos,
                                lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg)
            metrics["vespo/phi_seq_mean"] = phi.mean()
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    rewards, values, mask: (B, T); mask is 1 on the response tokens that act. Walking the
    valid tokens backwards, with t' the next valid token after t (none: V(t') = 0, A(t') = 0):

      δ_t = r_t + γ·V(t') - V(t),   A_t = δ_t + γ·λ·A(t')

    Masked tokens are skipped (their rewards are ignored), so holes in the mask, e.g. tool
    output inside a response, are stepped over. Returns (advantages, returns), both (B, T),
    returns = advantages + values on the valid tokens, both 0 where mask is 0; detached.
    """
    _check_shapes(rewards.shape, "rewards", values=values, mask=mask)
    if rewards.dim() != 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: expected (B, T)")
    rewards, values = _upcast(rewards), _upcast(values)
    mask = mask.to(rewards.dtype)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.size(1))):
        m = mask[:, t]
        adv_t = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        # A masked token leaves the carried (next value, next advantage) untouched.
        next_adv = m * adv_t + (1 - m) * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = m * adv_t
    return advantages, (advantages + values) * mask


def ppo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor,
             old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, cliprange: float = 0.2,
             cliprange_value: float = 0.2, vf_coef: float = 0.1, num_tokens: torch.Tensor | float | None = None,
             importance_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped policy loss plus its clipped value loss, masked means over the tokens.

    All arguments (B, T): per-token log-probs now and at sampling, advantages, value-head
    outputs now and at sampling, returns (e.g. from `gae`), and the mask of response tokens.
    With ρ = exp(logps - old_logps), c = cliprange, c_v = cliprange_value:

      policy  mean(max(-A·ρ, -A·clip(ρ, 1 - c, 1 + c)))
      value   mean(0.5·max((v - R)², (clip(v, v_old - c_v, v_old + c_v) - R)²))
      loss    policy + vf_coef·value

    num_tokens: the mean's denominator (default: mask.sum()); under data parallelism, the
    tokens of the whole batch / processes, so the averaged gradients are the whole batch's mean.
    importance_weights: (B, T) or None, detached: multiply each token's policy term (not the
    value term), for samples another sampler drew (`truncated_importance_weights`): the policy
    term's gradient is then an estimate under the policy at sampling time, not the sampler.
    Returns (loss, metrics) with "policy_loss", "value_loss", "clipfrac" (share of tokens where
    the clipped policy term is the larger), "value_clipfrac", "approx_kl" (mean ½(logps -
    old_logps)²), all detached.
    """
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}: expected (B, T)")
    _check_shapes(logps.shape, "logps", old_logps=old_logps, advantages=advantages, values=values,
                  old_values=old_values, returns=returns, mask=mask)
    logps, values = _upcast(logps), _upcast(values)
    mask = mask.to(logps.dtype)
    log_ratio = logps - _upcast(old_logps)
    ratio = torch.exp(log_ratio)
    pg_plain = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    denominator = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    policy_per_token = torch.maximum(pg_plain, pg_clipped)
    if importance_weights is not None:
        _check_shapes(logps.shape, "logps", importance_weights=importance_weights)
        policy_per_token = policy_per_token * _upcast(importance_weights).detach()
    policy = (policy_per_token * mask).sum() / denominator

    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf_plain = (values - returns) ** 2
    vf_clipped = (v_clipped - returns) ** 2
    value = 0.5 * (torch.maximum(vf_plain, vf_clipped) * mask).sum() / denominator

    with torch.no_grad():
        metrics = {
            "policy_loss": policy.detach(),
            "value_loss": value.detach(),
            "clipfrac": _masked_mean((pg_clipped > pg_plain).to(mask.dtype), mask),
            "value_clipfrac": _masked_mean((vf_clipped > vf_plain).to(mask.dtype), mask),
            "approx_kl": _masked_mean(0.5 * log_ratio ** 2, mask),
        }
    return policy + vf_coef * value, metrics


def per_token_rewards(logps: torch.Tensor, ref_logps: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, *,
                      kl_coef: float, kl_estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token rewards: r_t = -kl_coef·KL_t on every completion token, plus the score on the last.

    logps, ref_logps, mask: (B, T); scores: (B,); KL_t by `KL_ESTIMATORS[kl_estimator]`.
    Returns (rewards, kl), both (B, T), 0 where mask is 0. The last token is the last 1 of
    the mask (holes allowed); a row with an empty mask gets no score.
    """
    estimator = _pick(KL_ESTIMATORS, kl_estimator, "kl_estimator")
    mask = mask.to(logps.dtype)
    kl = estimator(logps, ref_logps) * mask
    rewards = -kl_coef * kl
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (positions * mask).argmax(-1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += scores.to(rewards.dtype) * (mask.sum(-1) > 0)
    return rewards, kl


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the entries where mask is 1 (unbiased variance).

    x, mask: same shape; 0 where mask is 0. shift_mean=False adds the mean back (PPO whitens
    per-token rewards that way, so their sign is kept). reduce: sums a tensor over the
    processes that share the batch (data parallelism), so mean and variance are the whole
    batch's, not this shard's; None: this tensor is the whole batch.
    """
    reduce = reduce or (lambda t: t)
    mask = mask.to(x.dtype)
    n = reduce(mask.sum())
    mean = reduce((x * mask).sum()) / n.clamp(min=1)
    var = reduce((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the valid tokens: 1 perfect, 0 no better than a constant.

    values, returns, mask: (B, T). NaN with fewer than 2 valid tokens.
    """
    select = mask.bool()
    returns, residual = returns[select], (returns - values)[select]
    if returns.numel() < 2:
        return torch.tensor(float("nan"))
    return 1 - residual.var() / returns.var().clamp(min=1e-8)
