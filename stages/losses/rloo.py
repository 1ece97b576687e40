"""REINFORCE leave-one-out (RLOO): its advantages and its sequence-level clipped loss.

Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs" (2024). Each prompt gets G completions; a completion's baseline is the mean reward
of the other G - 1, so the baseline is independent of the completion itself (an unbiased
REINFORCE gradient). The KL to the reference enters the reward (summed over the sequence), not
the loss, and the importance ratio is one per sequence.
"""
from __future__ import annotations

import torch

from stages.losses.numerics import _check_shapes, _upcast

_NORM_EPS = 1e-4


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, num_generations: int, *, valid: torch.Tensor | None = None,
                    kl: torch.Tensor | None = None, beta: float = 0.0,
                    reward_clip_range: tuple[float, float] | None = None, normalize: bool = False) -> torch.Tensor:
    """Leave-one-out advantages of B·G completions, G = num_generations consecutive ones per prompt.

    rewards: (B·G,) total reward per completion; valid: (B·G,) bool, False for an unscored completion
    (its reward is ignored, NaN allowed); kl: (B·G,) the completion's summed per-token log-ratio to
    the reference, log π_old - log π_ref over its tokens (needed when beta > 0). In order:

      r_i  <- clamp(r_i, *reward_clip_range)                    (when given)
      r_i  <- r_i - beta · kl_i                                  (the KL penalty is part of the reward)
      A_i   = r_i - (sum of the group's valid r - r_i) / (n_valid - 1)
      A     <- (A - mean(A)) / (std(A) + 1e-4) over the valid completions  (normalize)

    std is the unbiased (n - 1) one. A_i = 0 for an unscored completion and in a group with fewer
    than two scored completions (no one to leave the completion out against). Returns (B·G,), detached.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: expected (B·G,), one reward per completion")
    if num_generations < 2:
        raise ValueError(f"num_generations = {num_generations}: must be >= 2 (leave-one-out needs another "
                         "completion of the same prompt)")
    if rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} entries, not divisible by num_generations = "
                         f"{num_generations}: expected B·G, G completions for each prompt")
    _check_shapes(rewards.shape, "rewards", valid=valid, kl=kl)
    r = _upcast(rewards)
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool()
    r = torch.where(ok, r, 0)  # NaN placeholders must not leak through 0 * NaN
    if reward_clip_range is not None:
        low, high = reward_clip_range
        r = r.clamp(min=low, max=high)
    if beta != 0:
        if kl is None:
            raise ValueError(f"beta = {beta} but kl is None: pass each completion's summed log-ratio to the reference")
        r = r - beta * _upcast(kl)
    grouped, ok_g = r.view(-1, num_generations), ok.view(-1, num_generations)
    count = ok_g.sum(dim=1, keepdim=True)
    others = (torch.where(ok_g, grouped, 0).sum(dim=1, keepdim=True) - grouped) / (count - 1).clamp(min=1)
    advantages = torch.where(ok_g & (count > 1), grouped - others, 0).reshape(-1)
    keep = ok & (count > 1).expand_as(ok_g).reshape(-1)
    if normalize and keep.any():
        kept = advantages[keep]
        std = kept.std() if kept.numel() > 1 else kept.new_zeros(())
        advantages = torch.where(keep, (advantages - kept.mean()) / (std + _NORM_EPS), 0)
    return advantages


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              epsilon_low: float = 0.2, epsilon_high: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's clipped policy-gradient loss with one importance ratio per sequence.

    logps: (B, C) the policy's log-probs of the completion tokens (with gradient); old_logps: (B, C)
    the same at sampling time, or None when the samples are this policy's own (ratio 1, gradient of
    REINFORCE); advantages: (B,); mask: (B, C), 1 on the tokens that count. With s = sum of mask·logps:

      ρ_i   = exp(s_i - s_old_i)
      loss  = mean_i  -min(ρ_i A_i, clamp(ρ_i, 1 - ε_low, 1 + ε_high) A_i)

    ε_high defaults to ε_low. Metrics (detached): "clip_ratio/low_mean" (share of sequences with
    ρ < 1 - ε_low and A < 0), "clip_ratio/high_mean" (ρ > 1 + ε_high and A > 0), "clip_ratio/region_mean".
    """
    _check_shapes(logps.shape, "logps", old_logps=old_logps, mask=mask)
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}: expected ({logps.shape[0]},), one per "
                         "completion")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    m = mask.to(logps.dtype)
    seq = (_upcast(logps) * m).sum(dim=1)
    old = seq.detach() if old_logps is None else (_upcast(old_logps) * m).sum(dim=1)
    ratio = torch.exp(seq - old)
    a = _upcast(advantages)
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * a, clipped * a).mean()
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (a < 0)
        high = (ratio > 1 + epsilon_high) & (a > 0)
        metrics = {"clip_ratio/low_mean": low.float().mean(), "clip_ratio/high_mean": high.float().mean(),
                   "clip_ratio/region_mean": (low | high).float().mean()}
    return loss, metrics
