"""Reward models as a building block: loading one, reading its scalar reward, scoring texts, evaluating pairs.

A reward model is a one-output sequence classifier (`AutoModelForSequenceClassification`,
num_labels=1) on a causal LM's body; `load_reward_model` turns a causal LM folder into one or loads a
trained one. The reward is read at each row's last attended token (from the attention mask), whatever
the pad token: HF's own pooling is one token early when pad == EOS. `RewardTrainer`
(`stages.trainers.reward_trainer`) trains one; the `reward_model` reward function and the pipeline's
`reward` stage score with one.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from stages.data.formats import is_conversational
from stages.data.templates import maybe_extract_prompt
from stages.data.tokenize import tokenize_sft
from stages.logprobs import causal_lm
from stages.pair_packing import forward_inputs
from stages.sharding import unwrap
from stages.tensors import pad

log = logging.getLogger("stages")

HEAD_NAMES = ("score", "classifier")


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

        return with_pad_token(load_quantized(model, AutoModelForSequenceClassification, quantization_config, **kwargs),
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
            return with_pad_token(AutoModelForSequenceClassification.from_pretrained(
                path, quantization_config=quantization_config, device_map={"": 0}, **kwargs), tokenizer)
        if heads:
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        else:  # a causal LM: its lm_head is dropped and a fresh score head added, as intended; no load report
            with _quiet_transformers():
                model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
            log.info("reward model: %s's trunk under a fresh one-output score head", path)
    return with_pad_token(model.to(device), tokenizer)


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


def with_pad_token(model, tokenizer):
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
                     "*ForSequenceClassification model; load it with stages.reward_model.load_reward_model")


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pairs: bool = False
                     ) -> torch.Tensor:
    """One reward per row, read at the row's last attended token: input_ids, attention_mask (N, T) -> (N,).

    The head's per-position output (N, T, 1) is caught with a forward hook, so the model's
    own forward runs as usual (DDP/FSDP hooks fire, PEFT's trainable head copy is used) and
    the position comes from the mask, not from pad ids (see the module docstring). Works
    for left or right padding. pairs: the rows are a `RewardCollator` batch (B chosen, then B
    rejected); each pair then runs as one row packed on its shared prefix where the model allows
    (`stages.pair_packing`), with the same rewards.
    """
    inputs, unpack = forward_inputs(causal_lm(model), input_ids, attention_mask, pairs=pairs)
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



def pair_row(row: dict) -> dict:
    row = maybe_extract_prompt(row)
    if "prompt" not in row:  # nothing shared: the whole text is the completion
        row = {**row, "prompt": "" if isinstance(row["chosen"], str) else []}
    return row


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
    rows = [{"prompt": p, "completion": _as_completion(p, c)} for p, c in zip(prompts, completions, strict=True)]
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
    rows = [pair_row(r) for r in pairs]
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
