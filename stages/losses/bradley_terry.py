"""The reward model's Bradley-Terry loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.losses.numerics import _check_shapes, _upcast

# ---------------------------------------------------------------------------------------------
# Reward model (Bradley–Terry)
# ---------------------------------------------------------------------------------------------

def reward_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry pairwise loss of a scalar reward model, averaged over the B pairs.

    chosen_rewards, rejected_rewards: (B,) rewards r_c, r_r of the preferred and the other
    completion; margin: (B,) per-pair margin m (how much better the chosen is, Llama 2's
    reward margin) or None (m = 0); center_rewards_coefficient: c, or None / 0 for none.

      loss = mean(-log σ(r_c - r_r - m)) + c · mean((r_c + r_r)²)

    The second term (Eisenstein et al. 2023, "Helping or herding?") pulls the rewards
    towards zero mean; Bradley–Terry alone only fixes their differences.

    Returns (loss, metrics), metrics detached: "accuracy" (share of pairs with r_c > r_r;
    ties count as wrong), "margin" (mean r_c - r_r), "reward_min" / "reward_mean" /
    "reward_max" over all 2B rewards.
    """
    if chosen_rewards.dim() != 1:
        raise ValueError(f"chosen_rewards has shape {tuple(chosen_rewards.shape)}: expected (B,)")
    _check_shapes(chosen_rewards.shape, "chosen_rewards", rejected_rewards=rejected_rewards, margin=margin)
    if center_rewards_coefficient is not None and center_rewards_coefficient < 0:
        raise ValueError(f"center_rewards_coefficient = {center_rewards_coefficient}: must be >= 0 (or None)")
    chosen, rejected = _upcast(chosen_rewards), _upcast(rejected_rewards)
    diff = chosen - rejected
    logits = diff - margin.to(diff.dtype) if margin is not None else diff
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        both = torch.cat([chosen, rejected])
        metrics = {"accuracy": (diff > 0).to(diff.dtype).mean(), "margin": diff.mean(),
                   "reward_min": both.min(), "reward_mean": both.mean(), "reward_max": both.max()}
    return loss, metrics
