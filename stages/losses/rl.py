"""Online RL losses: per-token KL estimators, GRPO's advantages and clipped loss, PPO with GAE."""
from __future__ import annotations

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


GRPO_AGGREGATIONS = {
    # (per_token (B, T), mask (B, T), num_items_in_batch, max_completion_length) -> scalar
    "grpo": lambda x, m, n, L: ((x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).mean(),
    "bnpo": lambda x, m, n, L: (x * m).sum() / m.sum().clamp(min=1),
    # Dr. GRPO: a constant denominator, so neither a completion's length nor the batch's padding weights a token.
    "dr_grpo": lambda x, m, n, L: (x * m).sum() / (x.shape[0] * L),
    "dapo": lambda x, m, n, L: (x * m).sum() / (n if n is not None else m.sum().clamp(min=1)),
}


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
    down-weight on-policy tokens, whose ratio is 1).

    Returns (weights (B, T), metrics): "tis/mean_ratio", the mean uncapped ratio over the masked
    tokens, and "tis/frac_capped", the share of them whose ratio exceeded the cap.
    """
    _check_shapes(logps.shape, "logps", sampler_logps=sampler_logps, mask=mask)
    if not cap >= 1:
        raise ValueError(f"cap = {cap}: must be >= 1 (the largest importance weight; 2.0 is typical)")
    on = mask.bool()
    bad = (~torch.isfinite(sampler_logps) & on).nonzero()
    if len(bad):
        row, col = bad[0].tolist()
        raise ValueError(f"sampler_logps[{row}, {col}] = {sampler_logps[row, col].item()}: the sampler gave no "
                         f"finite log-prob for this token ({len(bad)} such tokens); the off-policy correction "
                         "needs one per sampled token (a vLLM server must answer `logprobs`)")
    ratio = torch.exp(_upcast(logps) - _upcast(sampler_logps))
    weights = torch.where(on, ratio.clamp(max=cap), 1.0)
    m = on.to(ratio.dtype)
    metrics = {"tis/mean_ratio": _masked_mean(torch.where(on, ratio, 0.0), m),
               "tis/frac_capped": _masked_mean((ratio > cap).to(m.dtype), m)}
    return weights, metrics


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon_low: float = 0.2,
              epsilon_high: float | None = None, loss_type: str = "grpo",
              num_items_in_batch: int | torch.Tensor | None = None, max_completion_length: int | None = None,
              importance_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate GRPO loss with an optional k3 KL penalty, aggregated by `loss_type`.

    logps, old_logps, ref_logps: (B, T) per-token completion log-probs under the policy, the
    policy that sampled (None: logps detached, i.e. one update per generation) and the
    reference; mask: (B, T), 1 on completion tokens; advantages: (B,), one per completion.
    Per token, with ρ = exp(logps - old_logps), ε_h = epsilon_high (default epsilon_low):

      ℓ = -min(ρ·A, clip(ρ, 1 - ε_low, 1 + ε_h)·A) + β·KL,  KL = exp(d) - d - 1,  d = ref_logps - logps

    (the k3 estimator `kl_k3`, always >= 0; skipped when β = 0, where ref_logps may be None).
    importance_weights: (B, T) or None, detached: multiply the policy-gradient term (not the KL) of
    each token, for samples another sampler drew (`truncated_importance_weights`). Then

      grpo     mean over each sequence's tokens, then over the B sequences
      bnpo     sum over all tokens / number of tokens
      dr_grpo  sum / (B·L), L = max_completion_length, the generation budget (required): a
               constant, so padding columns or the batch's longest completion change nothing
      dapo     sum / num_items_in_batch: the loss tokens of the whole generation batch (every
               micro-batch of the optimizer step, every process); summing the micro-batches'
               losses gives the token mean over that batch (default: this call's own count)

    Returns (loss, metrics), metrics detached, means over the masked tokens:
    "clip_ratio/low_mean" (ρ < 1 - ε_low and A < 0), "clip_ratio/high_mean" (ρ > 1 + ε_h and
    A > 0), "clip_ratio/region_mean" (either), and "kl" when β > 0.
    """
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}: expected (B, T)")
    _check_shapes(logps.shape, "logps", old_logps=old_logps, ref_logps=ref_logps, mask=mask)
    _check_shapes(logps.shape[:1], "logps[:, 0]", advantages=advantages)
    if beta < 0:
        raise ValueError(f"beta = {beta}: must be >= 0 (the KL penalty; 0 turns it off)")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps is None but beta = {beta}: the KL penalty needs the reference log-probs")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low = {epsilon_low}, epsilon_high = {epsilon_high}: must be >= 0")
    aggregate = _pick(GRPO_AGGREGATIONS, loss_type, "loss_type")
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
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if importance_weights is not None:
        _check_shapes(logps.shape, "logps", importance_weights=importance_weights)
        per_token = per_token * _upcast(importance_weights).detach()
    metrics = {}
    if beta > 0:
        kl = kl_k3(logps, _upcast(ref_logps))
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl, mask).detach()
    loss = aggregate(per_token, mask, num_items_in_batch, max_completion_length)

    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
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
