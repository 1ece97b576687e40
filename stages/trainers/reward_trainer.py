"""`RewardTrainer`: a `transformers.Trainer` for reward models (config: `reward_config.py`).

Rows are prompt/chosen/rejected (optional `margin`); chosen and rejected go through the model in
one forward (`stages.reward_model.sequence_rewards`) and `stages.losses.reward_loss` (Bradley-Terry,
margin, centring) is the loss. Loading and scoring a reward model: `stages.reward_model`. The
details: docs/trainers.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
from transformers import Trainer

from stages.data.tokenize import tokenize_sft
from stages.losses import reward_loss
from stages.precision import use_fp32_cpu_attention
from stages.reward_model import load_reward_model, pair_row, score_head, sequence_rewards, with_pad_token
from stages.sharding import unwrap
from stages.tensors import pad
from stages.trainers.eval_predictions import PairPredictions, loss_and_predictions
from stages.trainers.inputs import (
    apply_eos_to_model,
    apply_peft,
    disable_dropout,
    load_model,
    map_eval,
    offline_inputs,
)
from stages.trainers.method_fields import pad_multiple
from stages.trainers.offloading import OffloadsActivations
from stages.trainers.pair_batches import tokenized_dataset
from stages.trainers.reward_config import RewardConfig  # noqa: F401 (the config of this trainer, re-exported)


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int, *, start: int = 0) -> list[dict]:
    """prompt/chosen/rejected[/margin] rows -> chosen_input_ids, rejected_input_ids[, margin] per row. `start`: the
    index of the first of `rows` in the whole dataset (rows are tokenised in batches), for the messages."""
    identical = [start + i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]
    if identical:
        raise ValueError(f"preference row {identical[0]} has identical chosen and rejected ({len(identical)} such "
                         f"row(s): {identical[:10]}); they carry no preference: drop them before training")
    check_margins(rows, start=start)
    with_margin = any("margin" in r for r in rows)
    rows = [pair_row(r) for r in rows]
    out: list[dict] = [{} for _ in rows]
    for side in ("chosen", "rejected"):
        toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r[side], "tools": r.get("tools")}
                                        for r in rows],
                            max_length=max_length)
        for i, t in enumerate(toks):
            if not any(t["completion_mask"]):
                raise ValueError(f"preference row {start + i}: the prompt fills max_length = {max_length}; nothing of "
                                 f"the {side} completion is left (raise max_length or filter long prompts)")
            out[i][f"{side}_input_ids"] = t["input_ids"]
    for i, (r, o) in enumerate(zip(rows, out, strict=True), start=start):
        if o["chosen_input_ids"] == o["rejected_input_ids"]:
            raise ValueError(f"preference row {i}: chosen and rejected are identical after truncation to max_length "
                             f"= {max_length} (they differ only later); raise max_length or drop the row")
        if with_margin:
            m = r["margin"]
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise ValueError(f"preference row {i}: margin = {m!r}: must be a finite number")
            o["margin"] = float(m)
    return out


def check_margins(rows, *, start: int = 0) -> None:
    """Every row has a margin, or none does (a list of row dicts, or a Dataset: its margin column has no nulls)."""
    if not isinstance(rows, list):  # a datasets.Dataset: absent margins are nulls in its column
        if "margin" not in rows.column_names:
            return
        margins = rows["margin"]
        has = [i for i, m in enumerate(margins) if m is not None]
        if len(has) == len(margins):
            return
        missing = next(i for i, m in enumerate(margins) if m is None)
    else:
        has = [i for i, r in enumerate(rows) if "margin" in r]
        if not has or len(has) == len(rows):
            return
        missing = next(i for i, r in enumerate(rows) if "margin" not in r)
    raise ValueError(f"preference row {start + missing} has no margin but row {start + has[0]} has one: give every "
                     "row a margin or none")


@dataclass
class RewardCollator:
    """Features -> one batch of 2B right-padded rows (chosen first, then rejected) [+ margin (B,)]."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.tensor(f[f"{s}_input_ids"]) for s in ("chosen", "rejected") for f in features]
        batch = {"input_ids": pad(ids, padding_value=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of),
                 "attention_mask": pad([torch.ones_like(i) for i in ids], pad_to_multiple_of=self.pad_to_multiple_of)}
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([f["margin"] for f in features], dtype=torch.float32)
        return batch


# ---------------------------------------------------------------------------------- trainer

def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# how per-process values and a logging interval's per-step values are combined (default: mean)
_REDUCE = {"reward_min": min, "reward_max": max}


class RewardTrainer(PairPredictions, OffloadsActivations, Trainer):
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None):
        args, train_dataset, eval_dataset, processing_class = offline_inputs(
            RewardConfig, "Reward", model, args, train_dataset, eval_dataset, processing_class)
        model = load_model(model, args, quantization_config,
                           load=lambda path, **kwargs: load_reward_model(path, processing_class, **kwargs))
        model = apply_peft(model, peft_config, task_type="SEQ_CLS")  # PEFT then trains the whole score head
        apply_eos_to_model(model, processing_class, args)
        if args.disable_dropout:
            disable_dropout(model)

        def prepare(rows):
            import datasets

            if isinstance(rows, (list, datasets.Dataset)):
                check_margins(rows)  # across the whole dataset: a batch sees only its own rows
            return tokenized_dataset(rows, "chosen_input_ids",
                                     partial(tokenize_pairs, processing_class, max_length=args.max_length),
                                     tokenizer=processing_class, num_proc=getattr(args, "dataset_num_proc", None))

        score_head(model)  # fail early on a model without a reward head
        config = unwrap(model).config
        if config.pad_token_id is None:
            with_pad_token(unwrap(model), processing_class)
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or RewardCollator(
            processing_class.pad_token_id, pad_multiple(args.pad_to_multiple_of)), processing_class=processing_class,
            train_dataset=prepare(train_dataset),
            eval_dataset=map_eval(eval_dataset, prepare), compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards = sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"], pairs=True)
        chosen, rejected = rewards.chunk(2)
        loss, metrics = reward_loss(chosen, rejected, margin=inputs.get("margin"),
                                    center_rewards_coefficient=self.args.center_rewards_coefficient)
        mode = "train" if model.training else "eval"
        for key, value in metrics.items():
            gathered = self.accelerator.gather_for_metrics(value.reshape(1)).tolist()
            self._metrics[mode][key].append(_REDUCE.get(key, _mean)(gathered))
        return (loss, {"rewards": rewards.detach()}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval: the loss, and as predictions the rewards (2B, 1) of the batch's chosen then rejected rows; no
        labels (an empty tuple): TRL's EvalPrediction (stages.trainers.eval_predictions)."""
        return loss_and_predictions(self, model, self._prepare_inputs(inputs), prediction_loss_only,
                                    lambda _, __, out: (out["rewards"].reshape(-1, 1), ()))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._metrics[mode].items():
            logs[f"{prefix}{key}"] = _REDUCE.get(key, _mean)(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)
