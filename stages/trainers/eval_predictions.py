"""Evaluation of the trainers without labels: the loss, and what `compute_metrics` receives, as in TRL 1.16.

transformers' evaluation loop builds `EvalPrediction(predictions, label_ids)` from what `prediction_step`
returns, gathered over processes and concatenated over batches (`preprocess_logits_for_metrics(logits,
labels)` runs on each batch first). TRL 1.16's contents, kept so that a TRL `compute_metrics` works unchanged:

- RewardTrainer: predictions are the reward model's outputs (2B, 1) of each batch, its B chosen rows then
  its B rejected rows; label_ids is an empty tuple (there are no labels).
- DPOTrainer, and OnlineDPOTrainer on the pairs it samples: the policy's logits (2B, T, V) of the batch's
  chosen then rejected rows, and their input ids (2B, T) as label_ids (-100 pads batches of other widths).
- KTOTrainer: the policy's logits (B, T, V) and input ids (B, T) of the batch's rows.

The losses use chunked log-probs and never build logits, so the logits take one more forward, run only when
predictions are asked for (compute_metrics given), as TRL does. Pair batches are gathered half by half
(`PairPredictions`): on the last batch of an uneven dataset accelerate keeps as many rows as samples remain,
which would cut a (2B, ...) batch's rejected half (TRL 1.16 loses them so).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EVAL_DRAW = -1  # the draw (seed part) of the online trainers' evaluation samples: fixed, so evaluations differ only
# by the policy (GRPOTrainer.evaluate's too)


@torch.no_grad()
def policy_logits(trainer, model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's logits (rows, T, V), the input ids (rows, T)) of a batch: TRL's predictions and label_ids."""
    with trainer.compute_loss_context_manager():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits
    return logits.detach(), inputs["input_ids"]


# (model, prepared inputs, compute_loss's outputs) -> (predictions, label_ids)
Predict = Callable[[Any, dict[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]


@torch.no_grad()
def loss_and_predictions(trainer, model, inputs: dict[str, torch.Tensor], prediction_loss_only: bool,
                         predict: Predict | None = None):
    """`prediction_step` of a trainer without labels: (loss, predictions, label_ids), the last two from
    `predict(model, inputs, outputs)` (default: `policy_logits`) unless prediction_loss_only. `inputs`: prepared."""
    with trainer.compute_loss_context_manager():
        loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
    trainer._loss_gather_pending = True  # PairPredictions: the loop gathers this loss first
    if prediction_loss_only:
        return loss.detach(), None, None
    predictions, labels = (predict or (lambda m, b, _: policy_logits(trainer, m, b)))(model, inputs, outputs)
    return loss.detach(), predictions, labels


class PairPredictions:
    """Mixin of the trainers whose predictions hold each batch's pairs as 2B rows (chosen, then rejected): the
    evaluation loop gathers such a tensor as its two halves, each trimmed to the pairs that remain on the last
    batch, then joins them, so every pair keeps both rows (and the layout stays TRL's)."""

    _loss_gather_pending = False

    def evaluation_loop(self, *args, **kwargs):
        plain = self.gather_function  # type: ignore[has-type]

        def gather(data):
            if self._loss_gather_pending:  # transformers gathers a step's loss before its predictions and labels
                self._loss_gather_pending = False
                return plain(data)
            if isinstance(data, torch.Tensor) and data.dim() and data.shape[0] % 2 == 0:
                chosen, rejected = data.chunk(2)
                return torch.cat([plain(chosen), plain(rejected)])
            return plain(data)

        self.gather_function = gather
        try:
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.gather_function = plain
            self._loss_gather_pending = False
