"""Two per-pair corrections of DPO's sequence log-probs for length: LD-DPO and WPO.

Both work on per-token completion log-probs of a `PairCollator` batch: 2B rows, the B chosen
completions first, then the B rejected, right-padded, with `mask` (rows, T) marking the scored
completion tokens.

`ld_logps` (LD-DPO, arXiv:2409.06411): each row's summed log-prob, with the tokens past the pair's
shared length (the shorter of its chosen and rejected completions) scaled by `ld_alpha`:
    logp = Σ_{k ≤ ℓ} logp_k + α · Σ_{k > ℓ} logp_k,  ℓ = min(len_chosen, len_rejected),
k counting the row's completion tokens from 1. α = 1 is the plain sum; α = 0 drops the verbose tail.

`wpo_weights` (WPO, arXiv:2406.11827, Eq. 2): each pair's weight, the product over its two
completions of exp(mean_k [logp_k - log Σ_v p_k(v)²]), the policy's length-normalised probability of
the completion, aligned by the distribution's own Σ p² (so a sharp distribution is not favoured just
for being sharp). Detached: the weights scale the loss, they are not trained through.
"""
from __future__ import annotations

import torch


def _check(per_token: torch.Tensor, mask: torch.Tensor) -> None:
    if per_token.shape != mask.shape or per_token.dim() != 2 or per_token.shape[0] % 2:
        raise ValueError(f"per-token log-probs {tuple(per_token.shape)} and mask {tuple(mask.shape)} must be the "
                         "same (2B, T) shape: B chosen rows, then B rejected")


def ld_logps(per_token: torch.Tensor, mask: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's summed log-prob per row: (2B,). per_token, mask: (2B, T) (see the module docstring)."""
    _check(per_token, mask)
    mask = mask.to(per_token.dtype)
    position = mask.cumsum(-1)  # k: the completion token's index from 1 (0 before the completion)
    shared = torch.minimum(*mask.sum(-1).chunk(2)).repeat(2).unsqueeze(-1)  # ℓ per pair, for both rows
    scale = torch.where(position <= shared, torch.ones_like(mask), torch.full_like(mask, ld_alpha))
    return (per_token * mask * scale).sum(-1)


def log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v p(v)² of each position's distribution: logits (..., V) -> (...)."""
    return torch.logsumexp(2 * torch.log_softmax(logits.float(), dim=-1), dim=-1)


@torch.no_grad()
def wpo_weights(per_token: torch.Tensor, sum_sq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight per pair: (B,), detached. per_token: (2B, T) log-probs of the taken tokens; sum_sq: (2B, T)
    `log_sum_sq_probs` at the same positions; mask: (2B, T) the completion tokens."""
    _check(per_token, mask)
    _check(sum_sq, mask)
    mask = mask.to(per_token.dtype)
    mean = ((per_token - sum_sq) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    chosen, rejected = torch.exp(mean).chunk(2)
    return chosen * rejected
