"""Direct preference optimisation: `DPOConfig` + `DPOTrainer` (a `transformers.Trainer`).

Rows are prompt/chosen/rejected (strings or chat messages). Chosen and rejected go through
the model in one concatenated forward of 2B rows; their completion log-probs are summed
and fed, with the completion token counts, to the objectives named by `loss_type`
(`stages.trainers.objectives`: the `stages.losses.dpo_loss` variants, "sft", or user code by
dotted path). IPO divides the sums by the token counts itself, as in the IPO paper.
Log-probs come from the final hidden states of the completion positions through
`stages.kernels.chunked_logprobs` where the model allows (see `stages.trainers.logprobs`),
else from the logits through `stages.kernels.selective_log_softmax`.

The reference: a frozen copy of the starting model; with a PEFT model, the same weights
with the adapter disabled (no second copy in memory); none with `reference_free`; or
precomputed `ref_chosen_logps` / `ref_rejected_logps` columns in the dataset, either given
or computed once before training with `precompute_ref_log_probs` (`reference_logps_table`),
after which no reference model is kept (`compute_reference_logps` returns rows with the
columns, as the pipeline's `reference` stage caches them). The columns hold SUMMED log-probs: the token counts
come from the row's own completion mask, so one reference pass serves every loss type,
length-averaged (IPO) or not. They are only valid for the same tokenisation (tokenizer,
chat template, max_length) as training.

Weighting: `loss_type` may list several objectives with `loss_weights`; an optional `weight`
column scales each pair's loss, an optional `task` column with `task_weights` scales whole
tasks; `balance_column` draws batches balanced over a column (`stages.trainers.sampling`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import Trainer, TrainingArguments

from stages.data.tokenize import tokenize_sft
from stages.kernels import selective_log_softmax
from stages.trainers.logprobs import head_logprobs, lm_head_for_chunking, selected_hidden, unwrap
from stages.trainers.objectives import OBJECTIVES, check_objective_output, resolve_objective
from stages.trainers.sampling import BalancedBatchSampler, FlatSampler
from stages.utils import pad

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
BALANCE_KEY = "balance_key"  # the balance column's value per row, as a JSON string
REFERENCE_FORWARDS = 0  # reference forward passes run so far (see reference_sequence_logps); for tests/benchmarks


@dataclass
class DPOConfig(TrainingArguments):
    beta: float = field(default=0.1, metadata={"help": "KL strength (> 0; 0.1 is typical)"})
    loss_type: str | list[str] = field(default="sigmoid", metadata={
        "help": f"objective or list of objectives: {', '.join(OBJECTIVES)}, or 'package.module:function'"})
    loss_weights: list[float] | None = field(default=None, metadata={
        "help": "one weight per loss_type entry (default: all 1.0)"})
    label_smoothing: float = field(default=0.0, metadata={"help": "conservative DPO / robust: in [0, 0.5)"})
    reference_free: bool = field(default=False, metadata={"help": "no reference model (its log-probs taken as 0)"})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "compute the reference log-probs once before training; no reference model is kept"})
    max_length: int = field(default=1024, metadata={"help": "truncate prompt + completion to this many tokens"})
    use_chunked_logprobs: bool = field(default=True, metadata={"help": "log-probs without full logits if possible"})
    task_weights: dict[str, float] | None = field(default=None, metadata={
        "help": "loss scale per value of the rows' 'task' column (tasks not listed: 1.0)"})
    balance_column: str | None = field(default=None, metadata={
        "help": "draw batches balanced over this column (e.g. task, source, prompt)"})

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.beta <= 0:
            problems.append(f"beta = {self.beta}: must be > 0 (the KL strength; 0.1 is typical)")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing = {self.label_smoothing}: must be in [0, 0.5)")
        names = self.objective_names
        for i, name in enumerate(names):
            key = "loss_type" if isinstance(self.loss_type, str) else f"loss_type[{i}]"
            if name in OBJECTIVES:
                continue
            if ":" not in name:
                problems.append(f"{key} = {name!r}: supported: {', '.join(OBJECTIVES)}, or a dotted import path "
                                "'package.module:function'")
                continue
            try:
                resolve_objective(name)
            except ValueError as e:
                problems.append(f"{key} = {e}")
        if not names:
            problems.append("loss_type = []: name at least one objective")
        if self.loss_weights is not None:
            if len(self.loss_weights) != len(names):
                problems.append(f"loss_weights = {self.loss_weights}: {len(self.loss_weights)} weight(s) for "
                                f"{len(names)} loss_type entr(ies); give one per entry or None for all 1.0")
            if any(not (math.isfinite(w) and w >= 0) for w in self.loss_weights):
                problems.append(f"loss_weights = {self.loss_weights}: each must be a finite number >= 0")
        bad = {k: v for k, v in (self.task_weights or {}).items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            problems.append(f"task_weights = {self.task_weights}: {bad} must be finite numbers >= 0")
        if self.precompute_ref_log_probs and self.reference_free:
            problems.append("precompute_ref_log_probs = True with reference_free = True: there is no reference to "
                            "precompute; set one of them to False")
        if problems:
            raise ValueError("DPO config: " + "; ".join(problems))

    @property
    def objective_names(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int, keep: tuple[str, ...] = ()) -> list[dict]:
    """Each prompt/chosen/rejected row -> chosen_* and rejected_* input_ids and completion_mask.

    The columns REF_COLUMNS, "weight" and `keep` are carried over when present.
    """
    identical = [i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]
    if identical:
        raise ValueError(f"{len(identical)} preference row(s) have identical chosen and rejected (first: row "
                         f"{identical[0]}); they carry no preference: drop them in preprocess")
    carry = set(REF_COLUMNS) | {"weight", BALANCE_KEY} | set(keep)
    out = []
    for side in ("chosen", "rejected"):
        toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r[side]} for r in rows],
                            max_length=max_length)
        for i, t in enumerate(toks):
            if not any(t["completion_mask"]):
                raise ValueError(f"row {i}: the prompt fills max_length = {max_length}; nothing of the {side} "
                                 "completion is left (raise max_length or filter long prompts)")
            if side == "chosen":
                out.append({k: v for k, v in rows[i].items() if k in carry})
            out[i].update({f"{side}_input_ids": t["input_ids"], f"{side}_completion_mask": t["completion_mask"]})
    return out


def pair_weights(rows: list[dict], task_weights: dict[str, float] | None) -> list[dict]:
    """Fold the optional `weight` column and `task_weights[row["task"]]` into one `weight` per row."""
    if not any("weight" in r for r in rows) and not task_weights:
        return rows
    if task_weights:
        missing = [i for i, r in enumerate(rows) if "task" not in r]
        if missing:
            raise ValueError(f"task_weights is set but {len(missing)} row(s) have no 'task' column (first: row "
                             f"{missing[0]}); add it, or unset task_weights")
        unknown = sorted(set(task_weights) - {r["task"] for r in rows})
        if unknown:
            raise ValueError(f"task_weights names task(s) {unknown} that no row has; tasks in the data: "
                             f"{sorted({str(r['task']) for r in rows})}")
    out = []
    for i, r in enumerate(rows):
        w = r.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise ValueError(f"row {i}: weight = {w!r}: must be a finite number >= 0")
        out.append({**r, "weight": float(w) * (task_weights or {}).get(r.get("task"), 1.0)})
    return out


def with_balance_key(rows: list[dict], column: str | None) -> list[dict]:
    """Add BALANCE_KEY (the column's value as JSON, so chat-message prompts can be grouped too)."""
    if column is None:
        return rows
    missing = [i for i, r in enumerate(rows) if column not in r]
    if missing:
        raise ValueError(f"balance_column = {column!r}, but {len(missing)} row(s) lack it (first: row {missing[0]}, "
                         f"columns {sorted(rows[missing[0]])})")
    return [{**r, BALANCE_KEY: json.dumps(r[column], sort_keys=True)} for r in rows]


@dataclass
class PairCollator:
    """Features -> one batch of 2B rows: chosen first, then rejected; right-padded."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.tensor(f[f"{s}_input_ids"]) for s in ("chosen", "rejected") for f in features]
        masks = [torch.tensor(f[f"{s}_completion_mask"]) for s in ("chosen", "rejected") for f in features]
        batch = {"input_ids": pad(ids, padding_value=self.pad_token_id),
                 "attention_mask": pad([torch.ones_like(i) for i in ids]),
                 "completion_mask": pad(masks)}
        for col in (*REF_COLUMNS, "weight"):
            if col in features[0]:
                batch[col] = torch.tensor([f[col] for f in features], dtype=torch.float32)
        return batch


def sequence_logps(model, batch: dict[str, torch.Tensor], *, average: bool = False, chunked: bool = True
                   ) -> torch.Tensor:
    """Summed (or per-token averaged) completion log-probs of every row: (rows,)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    targets = batch["input_ids"][:, 1:]
    select = batch["completion_mask"][:, 1:].bool()
    head = lm_head_for_chunking(model) if chunked else None
    per_token = torch.zeros(select.shape, dtype=torch.float32, device=targets.device)
    if head is not None:
        hidden, _ = selected_hidden(model, inputs, select)
        per_token = per_token.masked_scatter(select, head_logprobs(hidden, head, targets[select]).float())
    else:
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        per_token = torch.where(select, selective_log_softmax(logits, targets).float(), per_token)
    total = per_token.sum(-1)
    return total / completion_token_counts(batch).clamp(min=1) if average else total


def completion_token_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Completion tokens scored per row (the first token is never predicted): (rows,)."""
    return batch["completion_mask"][:, 1:].sum(-1)


# ---- the reference, shared with the KTO and online DPO trainers ------------------------------

def is_peft(model) -> bool:
    return hasattr(unwrap(model), "peft_config") or hasattr(model, "disable_adapter")


def frozen_reference(model, ref_model=None, *, needed: bool = True):
    """The reference model to keep: `ref_model`, else a frozen copy of `model` when `needed` and
    `model` is not a PEFT model (whose reference is itself with the adapter disabled), else None."""
    if ref_model is None and needed and not is_peft(model):
        ref_model = copy.deepcopy(unwrap(model))
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
    return ref_model


@contextlib.contextmanager
def reference_model(model, ref_model):
    """The module to run as the reference: `ref_model` on `model`'s device, or `model` with its adapter off."""
    if ref_model is not None:
        yield ref_model.to(model.device)
    elif is_peft(model):
        with model.disable_adapter():
            yield model
    else:
        raise ValueError("no reference model: pass ref_model, use a PEFT model, or set reference_free")


@torch.no_grad()
def reference_sequence_logps(ref, batch: dict[str, torch.Tensor], *, chunked: bool = True) -> torch.Tensor:
    """`sequence_logps` (sums) under the reference, counted in REFERENCE_FORWARDS: (rows,)."""
    global REFERENCE_FORWARDS
    REFERENCE_FORWARDS += 1
    return sequence_logps(ref, batch, chunked=chunked)


@torch.no_grad()
def reference_logps_table(model, tokenizer, rows: list[dict], *, max_length: int, batch_size: int = 8,
                          average: bool = False, device: str | torch.device | None = None,
                          chunked: bool = True) -> torch.Tensor:
    """Reference log-probs of every pair, one no-grad pass: (N, 2) = [ref_chosen_logps, ref_rejected_logps].

    model: the reference itself (e.g. the SFT model, or a PEFT model inside `disable_adapter()`);
    rows: prompt/chosen/rejected rows or `tokenize_pairs` output. Sums over the completion tokens
    (the form the trainer's REF_COLUMNS take); average=True divides by the token counts.
    Runs in eval mode and restores the model's mode afterwards.
    """
    if rows and "chosen_input_ids" not in rows[0]:
        rows = tokenize_pairs(tokenizer, rows, max_length)
    collate = PairCollator(tokenizer.pad_token_id)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size]).items()}
            logps = reference_sequence_logps(model, batch, chunked=chunked)
            if average:
                logps = logps / completion_token_counts(batch).clamp(min=1)
            out.append(torch.stack(logps.chunk(2), dim=1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2)


def compute_reference_logps(model, tokenizer, rows: list[dict], *, max_length: int, batch_size: int = 8,
                            device: str | torch.device | None = None, chunked: bool = True) -> list[dict]:
    """`rows` with REF_COLUMNS added (summed log-probs, see `reference_logps_table`): what DPOTrainer
    reads instead of running a reference. Valid for training with the same tokenizer and max_length."""
    table = reference_logps_table(model, tokenizer, rows, max_length=max_length, batch_size=batch_size,
                                  device=device, chunked=chunked)
    return [{**r, REF_COLUMNS[0]: c, REF_COLUMNS[1]: rj} for r, (c, rj) in zip(rows, table.tolist())]


def preference_loss(objectives: list[tuple[str, Callable]], loss_weights: list[float], logps: torch.Tensor,
                    num_tokens: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None, *,
                    weight: torch.Tensor | None = None, beta: float, label_smoothing: float = 0.0,
                    reference_free: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of the objectives per pair, times the pair weights, averaged over pairs.

    logps, num_tokens: (2B,) summed completion log-probs and token counts, chosen rows first;
    ref_chosen, ref_rejected: (B,) summed reference log-probs (None with reference_free);
    weight: (B,) per-pair loss scale or None. Returns (loss, per-pair metrics (B,), detached):
    the implicit rewards of the first objective that has them, logps, and "loss/<name>" per
    objective when there are several.
    """
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = num_tokens.chunk(2)
    total, rewards, stats = 0.0, None, {}
    for (name, fn), w in zip(objectives, loss_weights):
        out = fn(chosen, rejected, ref_chosen, ref_rejected, beta=beta, chosen_num_tokens=n_chosen,
                 rejected_num_tokens=n_rejected, label_smoothing=label_smoothing, reference_free=reference_free)
        losses, chosen_rewards, rejected_rewards = check_objective_output(name, out, chosen.shape[0])
        total = total + w * losses
        if len(objectives) > 1:
            stats[f"loss/{name}"] = losses.detach()
        if rewards is None and chosen_rewards is not None:
            rewards = (chosen_rewards.detach(), rejected_rewards.detach())
    if weight is not None:
        total = total * weight.to(total.dtype)
    if rewards is not None:
        c, r = rewards
        stats.update({"rewards/chosen": c, "rewards/rejected": r, "rewards/accuracies": (c > r).float(),
                      "rewards/margins": c - r})
    stats.update({"logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()})
    return total.mean(), stats


def tokenized_dataset(rows, marker: str, tokenize: Callable[[list[dict]], list[dict]]):
    """`rows` (an iterable of dicts, or None) as a `datasets.Dataset`, passed through `tokenize` unless the
    first row already has the column `marker` (rows tokenized beforehand). None stays None."""
    import datasets

    if rows is None:
        return None
    rows = list(rows)
    if rows and marker not in rows[0]:
        rows = tokenize(rows)
    return datasets.Dataset.from_list(rows)


@torch.no_grad()
def loss_only_prediction_step(trainer: Trainer, model, inputs) -> tuple[torch.Tensor, None, None]:
    """`prediction_step` for trainers whose batches carry no `labels`: the loss only.

    (Trainer's own would run a bare forward, find no labels, and report no eval_loss.)
    """
    inputs = trainer._prepare_inputs(inputs)
    with trainer.compute_loss_context_manager():
        return trainer.compute_loss(model, inputs).detach(), None, None


def flush_metrics(metrics: dict[str, list[float]], logs: dict[str, float], prefix: str = "") -> None:
    """Average each accumulated metric into `logs` (keys prefixed) and clear them."""
    for key, values in metrics.items():
        logs[f"{prefix}{key}"] = sum(values) / len(values)
    metrics.clear()


class DPOTrainer(Trainer):
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, ref_model=None, *, args: DPOConfig, processing_class, train_dataset,
                 eval_dataset=None, **kwargs):
        def prepare(rows):
            if rows is not None:
                rows = with_balance_key(pair_weights(list(rows), args.task_weights), args.balance_column)
            return tokenized_dataset(rows, "chosen_input_ids",
                                     lambda r: tokenize_pairs(processing_class, r, args.max_length))

        args.remove_unused_columns = False
        kwargs.setdefault("data_collator", PairCollator(processing_class.pad_token_id))
        super().__init__(model=model, args=args, processing_class=processing_class, train_dataset=prepare(
            train_dataset), eval_dataset=prepare(eval_dataset), **kwargs)
        self.objectives = [(name, resolve_objective(name)) for name in args.objective_names]
        self.loss_weights = args.loss_weights or [1.0] * len(self.objectives)
        if args.precompute_ref_log_probs and not self._has_ref_columns():
            self._precompute_reference(ref_model)
            ref_model = None  # dropped: the columns replace it
        self.ref_model = frozen_reference(self.model, ref_model,
                                          needed=not args.reference_free and not self._has_ref_columns())
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _has_ref_columns(self) -> bool:
        return all(d is None or set(REF_COLUMNS) <= set(d.column_names) for d in (self.train_dataset,
                                                                                 self.eval_dataset))

    def _precompute_reference(self, ref_model) -> None:
        """Add REF_COLUMNS to the datasets: one reference pass; the policy at step 0 is the reference."""
        ref = ref_model if ref_model is not None or is_peft(self.model) else unwrap(self.model)
        for split in ("train_dataset", "eval_dataset"):
            data = getattr(self, split)
            if data is None or set(REF_COLUMNS) <= set(data.column_names):
                continue
            with reference_model(self.model, ref) as module, self.compute_loss_context_manager():
                logps = reference_logps_table(
                    module, self.processing_class, data.to_list(), max_length=self.args.max_length,
                    batch_size=self.args.per_device_eval_batch_size, device=self.args.device,
                    chunked=self.args.use_chunked_logprobs)
            data = data.remove_columns([c for c in REF_COLUMNS if c in data.column_names])
            for j, col in enumerate(REF_COLUMNS):
                data = data.add_column(col, logps[:, j].tolist())
            setattr(self, split, data)

    def _get_train_sampler(self, train_dataset=None):
        if self.args.balance_column is None:
            return super()._get_train_sampler(train_dataset)
        data = train_dataset if train_dataset is not None else self.train_dataset
        return FlatSampler(BalancedBatchSampler(data[BALANCE_KEY], self._train_batch_size, seed=self.args.seed))

    def reference_logps(self, model, batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Summed reference log-probs of the chosen and rejected completions: (B,) each."""
        if all(c in batch for c in REF_COLUMNS):
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.args.reference_free:
            return None, None
        with reference_model(model, self.ref_model) as ref:
            return reference_sequence_logps(ref, batch, chunked=self.args.use_chunked_logprobs).chunk(2)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps = sequence_logps(model, inputs, chunked=self.args.use_chunked_logprobs)
        ref_chosen, ref_rejected = self.reference_logps(model, inputs)
        loss, stats = preference_loss(self.objectives, self.loss_weights, logps, completion_token_counts(inputs),
                                      ref_chosen, ref_rejected, weight=inputs.get("weight"), beta=self.args.beta,
                                      label_smoothing=self.args.label_smoothing,
                                      reference_free=self.args.reference_free)
        mode = "train" if model.training else "eval"
        for key, value in stats.items():
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return loss_only_prediction_step(self, model, inputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        flush_metrics(self._metrics[mode], logs, "eval_" if mode == "eval" else "")
        super().log(logs, start_time)
