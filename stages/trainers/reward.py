"""Reward models: `RewardTrainer` (a `transformers.Trainer`; config: `reward_config.py`), loading and scoring.

A reward model is a one-output sequence classifier (`AutoModelForSequenceClassification`,
num_labels=1) on a causal LM's body; `load_reward_model` turns a causal LM folder into one or loads a
trained one. Rows are prompt/chosen/rejected (optional `margin`); chosen and rejected go through the
model in one forward and `stages.losses.reward_loss` (Bradley-Terry, margin, centring) is the loss.
The reward is read at each row's last attended token (from the attention mask), whatever the pad
token: HF's own pooling is one token early when pad == EOS. The details: docs/trainers.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer

from stages.data.formats import is_conversational
from stages.data.templates import maybe_extract_prompt
from stages.data.tokenize import tokenize_sft
from stages.losses import reward_loss
from stages.trainers.inputs import apply_peft, load_model, map_eval, offline_inputs, refuse
from stages.trainers.pair_packing import forward_inputs
from stages.trainers.preference import tokenized_dataset
from stages.trainers.logprobs import unwrap
from stages.trainers.precision import use_fp32_cpu_attention
from stages.utils import pad
from stages.trainers.reward_config import RewardConfig  # noqa: F401 (the config of this trainer, re-exported)

log = logging.getLogger("stages")

HEAD_NAMES = ("score", "classifier")


# ------------------------------------------------------------------------------------ model

def load_reward_model(path: str, tokenizer=None, *, dtype: str = "float32", device: str = "cpu",
                      trust_remote_code: bool = False, quantization_config=None, require_head: bool = False):
    """A one-output sequence classifier from a causal LM folder, a reward model folder or a PEFT adapter folder.

    A causal LM gets a new, randomly initialised `score` head (HF reports it as newly
    initialised); a reward model keeps its head, which must have exactly one output.
    `require_head`: fail unless the folder already is a sequence classifier (for scoring,
    where a random head would be meaningless). `config.pad_token_id` is set from
    `tokenizer` (loaded from `path` when not given).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from stages.models import load_tokenizer

    kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code, "num_labels": 1}
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, trust_remote_code=trust_remote_code)
    adapter = Path(path) / "adapter_config.json"
    if adapter.exists() and json.loads(adapter.read_text()).get("task_type") != "SEQ_CLS":
        model = _classifier_from_causal_adapter(path, dtype=dtype, trust_remote_code=trust_remote_code)
    elif adapter.exists():  # LoRA reward model: base + adapter + saved score head
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(path, **kwargs).merge_and_unload()
        model.requires_grad_(True)
    if adapter.exists() and quantization_config is not None:  # QLoRA: merged at full precision, then quantised
        from stages.models import load_quantized

        return _with_pad(load_quantized(model, AutoModelForSequenceClassification, quantization_config, **kwargs),
                         tokenizer)
    if not adapter.exists():
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        heads = [a for a in config.architectures or [] if a.endswith("ForSequenceClassification")]
        if heads and config.num_labels != 1:
            raise ValueError(f"{path}: its classification head ({heads[0]}) has {config.num_labels} outputs; a reward "
                             "model has exactly one (a scalar reward). Start from the causal LM it was made from, or "
                             "from a reward model trained with num_labels = 1")
        if require_head and not heads:
            raise ValueError(f"{path} is not a reward model (architectures: {config.architectures}; no "
                             "*ForSequenceClassification head); train one with RewardTrainer and point at its folder")
        if quantization_config is not None:
            return _with_pad(AutoModelForSequenceClassification.from_pretrained(
                path, quantization_config=quantization_config, device_map={"": 0}, **kwargs), tokenizer)
        if heads:
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        else:  # a causal LM: its lm_head is dropped and a fresh score head added, as intended; no load report
            with _quiet_transformers():
                model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
            log.info("reward model: %s's trunk under a fresh one-output score head", path)
    return _with_pad(model.to(device), tokenizer)


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _classifier_from_causal_adapter(path: str, *, dtype: str, trust_remote_code: bool):
    """A causal-LM LoRA folder (e.g. a LoRA SFT model): its merged trunk under a fresh one-output head."""
    from transformers import AutoModelForSequenceClassification

    from stages.models import load_causal_lm

    lm = load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code)  # base + adapter, merged
    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config, dtype=getattr(torch, dtype),
                                                           trust_remote_code=trust_remote_code)
    trunk = getattr(lm, lm.base_model_prefix)
    getattr(model, model.base_model_prefix).load_state_dict(trunk.state_dict())
    return model


def _with_pad(model, tokenizer):
    if tokenizer.pad_token_id is None:
        raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no pad token; set "
                         "tokenizer.pad_token (EOS is the usual stand-in; stages.models.load_tokenizer does that)")
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def score_head(model) -> nn.Module:
    """The classifier head (`score`, or `classifier`) of a sequence classifier, through DDP/PEFT wrappers."""
    inner = unwrap(model)
    for name in HEAD_NAMES:
        head = getattr(inner, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(inner).__name__} has no {' or '.join(HEAD_NAMES)} head: a reward model is a "
                     "*ForSequenceClassification model; load it with stages.trainers.reward.load_reward_model")


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pairs: bool = False
                     ) -> torch.Tensor:
    """One reward per row, read at the row's last attended token: input_ids, attention_mask (N, T) -> (N,).

    The head's per-position output (N, T, 1) is caught with a forward hook, so the model's
    own forward runs as usual (DDP/FSDP hooks fire, PEFT's trainable head copy is used) and
    the position comes from the mask, not from pad ids (see the module docstring). Works
    for left or right padding. pairs: the rows are a `RewardCollator` batch (B chosen, then B
    rejected); each pair then runs as one row packed on its shared prefix where the model allows
    (`stages.trainers.pair_packing`), with the same rewards.
    """
    inputs, unpack = forward_inputs(model, input_ids, attention_mask, pairs=pairs)
    captured = []
    handle = score_head(model).register_forward_hook(lambda _module, _args, out: captured.append(out))
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    scores = unpack(captured[-1])
    if scores.shape[-1] != 1:
        raise ValueError(f"the reward head has {scores.shape[-1]} outputs; a reward model has exactly one "
                         "(load it with load_reward_model, which sets num_labels = 1)")
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(-1)
    return scores[torch.arange(scores.shape[0], device=scores.device), last.to(scores.device), 0]


# ------------------------------------------------------------------------------------- data

def _pair_row(row: dict) -> dict:
    row = maybe_extract_prompt(row)
    if "prompt" not in row:  # nothing shared: the whole text is the completion
        row = {**row, "prompt": "" if isinstance(row["chosen"], str) else []}
    return row


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int, *, start: int = 0) -> list[dict]:
    """prompt/chosen/rejected[/margin] rows -> chosen_input_ids, rejected_input_ids[, margin] per row. `start`: the
    index of the first of `rows` in the whole dataset (rows are tokenised in batches), for the messages."""
    identical = [start + i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]
    if identical:
        raise ValueError(f"preference row {identical[0]} has identical chosen and rejected ({len(identical)} such "
                         f"row(s): {identical[:10]}); they carry no preference: drop them before training")
    check_margins(rows, start=start)
    with_margin = any("margin" in r for r in rows)
    rows = [_pair_row(r) for r in rows]
    out: list[dict] = [{} for _ in rows]
    for side in ("chosen", "rejected"):
        toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r[side]} for r in rows],
                            max_length=max_length)
        for i, t in enumerate(toks):
            if not any(t["completion_mask"]):
                raise ValueError(f"preference row {start + i}: the prompt fills max_length = {max_length}; nothing of "
                                 f"the {side} completion is left (raise max_length or filter long prompts)")
            out[i][f"{side}_input_ids"] = t["input_ids"]
    for i, (r, o) in enumerate(zip(rows, out), start=start):
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

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.tensor(f[f"{s}_input_ids"]) for s in ("chosen", "rejected") for f in features]
        batch = {"input_ids": pad(ids, padding_value=self.pad_token_id),
                 "attention_mask": pad([torch.ones_like(i) for i in ids])}
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([f["margin"] for f in features], dtype=torch.float32)
        return batch


# ---------------------------------------------------------------------------------- trainer

def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# how per-process values and a logging interval's per-step values are combined (default: mean)
_REDUCE = {"reward_min": min, "reward_max": max}


class RewardTrainer(Trainer):
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None):
        refuse("RewardTrainer", compute_metrics=compute_metrics,
               preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        args, train_dataset, eval_dataset, processing_class = offline_inputs(
            RewardConfig, "Reward", model, args, train_dataset, eval_dataset, processing_class)
        model = load_model(model, args, quantization_config,
                           load=lambda path, **kwargs: load_reward_model(path, processing_class, **kwargs))
        model = apply_peft(model, peft_config, task_type="SEQ_CLS")  # PEFT then trains the whole score head

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
            _with_pad(unwrap(model), processing_class)
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.trainers.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or RewardCollator(
            processing_class.pad_token_id), processing_class=processing_class, train_dataset=prepare(train_dataset),
            eval_dataset=map_eval(eval_dataset, prepare), callbacks=callbacks, optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
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
        """Eval: the loss, and the (B, 2) chosen/rejected rewards as predictions (there are no labels)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, out = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), torch.stack(out["rewards"].chunk(2), dim=1), None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._metrics[mode].items():
            logs[f"{prefix}{key}"] = _REDUCE.get(key, _mean)(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)


# ------------------------------------------------------------------------ scoring and evaluation

def _as_completion(prompt, completion):
    """A plain-string completion after a chat prompt becomes one assistant message."""
    if is_conversational({"prompt": prompt}) and isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return completion


@torch.no_grad()
def score_texts(model, tokenizer, prompts: list, completions: list, *, batch_size: int = 64,
                max_length: int = 1024) -> list[float]:
    """The reward of each prompt + completion (strings or chat messages), rendered as in training.

    Runs in eval mode without gradients (the previous train/eval mode is restored), in
    batches of `batch_size` right-padded rows on the model's device. Returns len(prompts) floats.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: one completion per prompt")
    if batch_size <= 0:
        raise ValueError(f"batch_size = {batch_size}: must be > 0")
    rows = [{"prompt": p, "completion": _as_completion(p, c)} for p, c in zip(prompts, completions)]
    toks = tokenize_sft(tokenizer, rows, max_length=max_length)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        for start in range(0, len(toks), batch_size):
            ids = [torch.tensor(t["input_ids"]) for t in toks[start:start + batch_size]]
            input_ids = pad(ids, padding_value=tokenizer.pad_token_id).to(device)
            mask = pad([torch.ones_like(i) for i in ids]).to(device)
            out.extend(sequence_rewards(model, input_ids, mask).float().tolist())
    finally:
        model.train(was_training)
    return out


def evaluate_reward_model(model, tokenizer, pairs: list[dict], *, batch_size: int = 64, max_length: int = 1024,
                          bins: int = 10) -> dict:
    """Held-out pair accuracy, mean margin and a reliability table of a reward model.

    With d = r_c - r_r per pair, the model's P(chosen preferred) = σ(d). In held-out pairs
    the chosen side is always the preferred one, so binning σ(d) against "was the chosen
    preferred" would compare every bin with 1.0. The table instead bins the model's
    confidence in the side it prefers, c = max(σ(d), 1 - σ(d)) = σ(|d|) ∈ [0.5, 1], into
    `bins` equal-width bins of [0.5, 1] and sets each bin's mean confidence against its
    accuracy (share of pairs with d > 0) — the standard reliability diagram, with ties
    (d = 0, c = 0.5) counted as wrong. ECE = Σ_bins (count / n) · |accuracy - mean confidence|.

    Returns {"pairs", "accuracy", "mean_margin", "ece", "calibration": [{"lower", "upper",
    "count", "mean_confidence", "accuracy"} per bin; the last two None for empty bins]}.
    """
    if not pairs:
        raise ValueError("evaluate_reward_model: no pairs to evaluate")
    if bins <= 0:
        raise ValueError(f"bins = {bins}: must be > 0")
    rows = [_pair_row(r) for r in pairs]
    prompts = [r["prompt"] for r in rows]
    kw = {"batch_size": batch_size, "max_length": max_length}
    chosen = torch.tensor(score_texts(model, tokenizer, prompts, [r["chosen"] for r in rows], **kw),
                          dtype=torch.float64)
    rejected = torch.tensor(score_texts(model, tokenizer, prompts, [r["rejected"] for r in rows], **kw),
                            dtype=torch.float64)
    diff = chosen - rejected
    confidence, correct = torch.sigmoid(diff.abs()), (diff > 0).double()
    which = ((confidence - 0.5) * 2 * bins).floor().long().clamp(0, bins - 1)
    table, ece, n = [], 0.0, len(rows)
    for b in range(bins):
        sel = which == b
        count = int(sel.sum())
        conf = confidence[sel].mean().item() if count else None
        acc = correct[sel].mean().item() if count else None
        if count:
            ece += count / n * abs(acc - conf)
        table.append({"lower": 0.5 + 0.5 * b / bins, "upper": 0.5 + 0.5 * (b + 1) / bins, "count": count,
                      "mean_confidence": conf, "accuracy": acc})
    return {"pairs": n, "accuracy": correct.mean().item(), "mean_margin": diff.mean().item(), "ece": ece,
            "calibration": table}
