"""Supervised fine-tuning: `SFTConfig` + `SFTTrainer` (a `transformers.Trainer`).

Rows are prompt/completion (strings or chat messages) or plain text; they are tokenised
with the chat template and a completion mask built from positions. With
`completion_only_loss` the loss covers completion tokens only. The loss itself is
`stages.losses.sft_loss` (from logits) or `sft_loss_from_logps`; this module only feeds it.

Memory: with `use_chunked_logprobs` (default) and a model whose output layer allows it
(see `stages.trainers.logprobs`), the loss is computed from the final hidden states of
the labelled positions only, through `stages.kernels.chunked_logprobs`: the (batch,
tokens, vocab) logits are never built. Otherwise it falls back to the full logits.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from stages.data.tokenize import tokenize_sft
from stages.losses import IGNORE_INDEX, sft_loss, sft_loss_from_logps
from stages.trainers.logprobs import head_argmax, head_logprobs, lm_head_for_chunking, selected_hidden


@dataclass
class SFTConfig(TrainingArguments):
    max_seq_length: int = field(default=1024, metadata={"help": "truncate tokenised rows to this length"})
    completion_only_loss: bool = field(default=True, metadata={"help": "loss on completion tokens only"})
    use_chunked_logprobs: bool = field(default=True, metadata={
        "help": "loss from hidden states through the chunked lm-head kernel (no full logits) where the model allows"})


@dataclass
class SFTCollator:
    """Right-pads `input_ids`; labels are the ids on completion (or all real) tokens, IGNORE_INDEX elsewhere."""

    pad_token_id: int
    completion_only_loss: bool = True

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            row = torch.tensor(f["input_ids"], dtype=torch.long)
            ids[i, :n], attention[i, :n] = row, 1
            keep = torch.tensor(f["completion_mask"], dtype=torch.bool) if self.completion_only_loss else \
                torch.ones(n, dtype=torch.bool)
            labels[i, :n] = torch.where(keep, row, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}


class SFTTrainer(Trainer):
    # compute_loss divides by the token count of the whole accumulated batch itself
    loss_is_scaled_for_ga = True

    def __init__(self, model, args: SFTConfig, *, processing_class, train_dataset, eval_dataset=None, **kwargs):
        import datasets

        def prepare(rows):
            if rows is None or (len(rows) and "input_ids" in rows[0]):
                return rows
            return datasets.Dataset.from_list(tokenize_sft(processing_class, list(rows), max_length=args.max_seq_length))

        args.remove_unused_columns = False  # the collator needs completion_mask
        kwargs.setdefault("data_collator", SFTCollator(processing_class.pad_token_id, args.completion_only_loss))
        super().__init__(model=model, args=args, processing_class=processing_class,
                         train_dataset=prepare(train_dataset), eval_dataset=prepare(eval_dataset), **kwargs)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        head = lm_head_for_chunking(model) if self.args.use_chunked_logprobs else None
        if head is not None:
            targets = labels[:, 1:]
            select = targets != IGNORE_INDEX
            hidden, outputs = selected_hidden(model, inputs, select)
            logps = head_logprobs(hidden, head, targets[select])
            loss = sft_loss_from_logps(logps, num_items_in_batch=num_items_in_batch)
            stats = {"num_tokens": select.sum(), "correct_tokens": (head_argmax(hidden.detach(), head)
                                                                    == targets[select]).sum()}
        else:
            outputs = model(**inputs, use_cache=False)
            loss, stats = sft_loss(outputs.logits, labels, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages grads; the denominator is already global
        mode = "train" if model.training else "eval"
        tokens = self.accelerator.gather_for_metrics(stats["num_tokens"].reshape(1)).sum()
        correct = self.accelerator.gather_for_metrics(stats["correct_tokens"].reshape(1)).sum()
        self._metrics[mode]["num_tokens"].append(tokens.item())
        self._metrics[mode]["mean_token_accuracy"].append((correct / tokens.clamp(min=1)).item())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        m = self._metrics[mode]
        if m:
            logs[f"{prefix}mean_token_accuracy"] = sum(m["mean_token_accuracy"]) / len(m["mean_token_accuracy"])
            logs[f"{prefix}num_tokens"] = float(sum(m["num_tokens"]))
        self._metrics[mode].clear()
        super().log(logs, start_time)
