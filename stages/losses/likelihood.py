"""Supervised fine-tuning's loss: token cross-entropy, from logits or from the labels' log-probs.

`SFT_LOSSES` names the per-token loss of each `SFTConfig.loss_type`: "nll" is -log p; "dft" (Dynamic
Fine-Tuning, arXiv:2508.05629) is -log p weighted by p, with p held constant (no gradient through the weight),
so tokens the model already finds unlikely pull less.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _nll(logps: torch.Tensor) -> torch.Tensor:
    return -logps


def _dft(logps: torch.Tensor) -> torch.Tensor:
    return -logps * logps.detach().exp()


# loss_type -> per-token loss from the labels' log-probs: (N,) -> (N,)
SFT_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"nll": _nll, "dft": _dft}


def token_loss_fn(loss_type: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if loss_type not in SFT_LOSSES:
        raise ValueError(f"sft.loss_type = {loss_type!r}: expected one of {', '.join(SFT_LOSSES)}")
    return SFT_LOSSES[loss_type]


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items_in_batch: int | torch.Tensor | None = None,
             loss_type: str = "nll") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token loss over the labelled positions (`SFT_LOSSES[loss_type]` per token).

    logits: (B, T, V) model outputs; labels: (B, T) token ids, IGNORE_INDEX where no loss
    (prompt and padding). Position t predicts labels[t + 1]. The sum of token losses is
    divided by `num_items_in_batch` (labelled tokens across all gradient-accumulation
    micro-batches and devices) when given, else by this batch's labelled-token count, so
    batch 1 x accumulation 8 and batch 8 x accumulation 1 give the same update.

    Returns (loss, {"num_tokens", "correct_tokens"}) with the metrics detached.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    logps = -F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    token_loss = token_loss_fn(loss_type)(logps)
    num_tokens = mask.sum()
    denom = num_items_in_batch if num_items_in_batch is not None else num_tokens.clamp(min=1)
    loss = token_loss.sum() / denom
    return loss, token_counts(logits.detach(), labels)


def token_counts(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"num_tokens": labelled positions, "correct_tokens": those whose argmax is the label}: scalars.

    logits: (B, T, V); labels: (B, T), IGNORE_INDEX where no loss; position t predicts labels[t + 1].
    """
    with torch.no_grad():
        shift_labels = labels[:, 1:]
        mask = shift_labels != IGNORE_INDEX
        correct = ((logits[:, :-1].argmax(-1) == shift_labels) & mask).sum()
    return {"num_tokens": mask.sum(), "correct_tokens": correct}


def sft_loss_from_logps(logps: torch.Tensor, *, num_items_in_batch: int | torch.Tensor | None = None,
                        loss_type: str = "nll") -> torch.Tensor:
    """The same loss as `sft_loss`, from the labelled tokens' log-probs: (N,) -> scalar.

    sum(SFT_LOSSES[loss_type](logps)) / num_items_in_batch (or / N): what the chunked log-prob path of
    the SFT trainer uses, where the (B, T, V) logits are never built.
    """
    denom = num_items_in_batch if num_items_in_batch is not None else max(logps.numel(), 1)
    return token_loss_fn(loss_type)(logps).sum() / denom
