"""Direct preference optimisation: `DPOConfig` + `DPOTrainer` (a `transformers.Trainer`).

Rows are prompt/chosen/rejected (strings or chat messages). Chosen and rejected go through
the model in one concatenated forward of 2B rows; their completion log-probs are summed
(averaged per token for IPO, as in the IPO paper) and fed to `stages.losses.dpo_loss`.
Log-probs come from the final hidden states of the completion positions through
`stages.kernels.chunked_logprobs` where the model allows (see `stages.trainers.logprobs`),
else from the logits through `stages.kernels.selective_log_softmax`.

The reference: a frozen copy of the starting model; with a PEFT model, the same weights
with the adapter disabled (no second copy in memory); none with `reference_free`; or
precomputed `ref_chosen_logps` / `ref_rejected_logps` columns in the dataset.
"""
from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from stages.data.tokenize import tokenize_sft
from stages.kernels import selective_log_softmax
from stages.losses import DPO_LOSSES, dpo_loss
from stages.trainers.logprobs import head_logprobs, lm_head_for_chunking, selected_hidden, unwrap
from stages.utils import pad

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclass
class DPOConfig(TrainingArguments):
    beta: float = field(default=0.1, metadata={"help": "KL strength (> 0; 0.1 is typical)"})
    loss_type: str = field(default="sigmoid", metadata={"help": f"one of {', '.join(DPO_LOSSES)}"})
    label_smoothing: float = field(default=0.0, metadata={"help": "conservative DPO / robust: in [0, 0.5)"})
    reference_free: bool = field(default=False, metadata={"help": "no reference model (its log-probs taken as 0)"})
    max_length: int = field(default=1024, metadata={"help": "truncate prompt + completion to this many tokens"})
    use_chunked_logprobs: bool = field(default=True, metadata={"help": "log-probs without full logits if possible"})

    def __post_init__(self):
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"beta = {self.beta}: must be > 0 (the KL strength; 0.1 is typical)")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing = {self.label_smoothing}: must be in [0, 0.5)")
        if self.loss_type not in DPO_LOSSES:
            raise ValueError(f"loss_type = {self.loss_type!r}: supported: {', '.join(DPO_LOSSES)}")


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int) -> list[dict]:
    """Each prompt/chosen/rejected row -> chosen_* and rejected_* input_ids and completion_mask."""
    identical = [i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]
    if identical:
        raise ValueError(f"{len(identical)} preference row(s) have identical chosen and rejected (first: row "
                         f"{identical[0]}); they carry no preference: drop them in preprocess")
    out = []
    for side in ("chosen", "rejected"):
        toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r[side]} for r in rows],
                            max_length=max_length)
        for i, t in enumerate(toks):
            if not any(t["completion_mask"]):
                raise ValueError(f"row {i}: the prompt fills max_length = {max_length}; nothing of the {side} "
                                 "completion is left (raise max_length or filter long prompts)")
            if side == "chosen":
                out.append({k: v for k, v in rows[i].items() if k in REF_COLUMNS})
            out[i].update({f"{side}_input_ids": t["input_ids"], f"{side}_completion_mask": t["completion_mask"]})
    return out


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
        for col in REF_COLUMNS:
            if col in features[0]:
                batch[col] = torch.tensor([f[col] for f in features], dtype=torch.float32)
        return batch


def sequence_logps(model, batch: dict[str, torch.Tensor], *, average: bool = False, chunked: bool = True
                   ) -> torch.Tensor:
    """Summed (or per-token averaged) completion log-probs of every row: (2B,)."""
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
    return total / select.sum(-1).clamp(min=1) if average else total


class DPOTrainer(Trainer):
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, ref_model=None, *, args: DPOConfig, processing_class, train_dataset,
                 eval_dataset=None, **kwargs):
        import datasets

        def prepare(rows):
            if rows is None:
                return None
            rows = list(rows)
            if rows and "chosen_input_ids" not in rows[0]:
                rows = tokenize_pairs(processing_class, rows, args.max_length)
            return datasets.Dataset.from_list(rows)

        args.remove_unused_columns = False
        kwargs.setdefault("data_collator", PairCollator(processing_class.pad_token_id))
        super().__init__(model=model, args=args, processing_class=processing_class, train_dataset=prepare(
            train_dataset), eval_dataset=prepare(eval_dataset), **kwargs)
        self.is_peft = hasattr(unwrap(self.model), "peft_config") or hasattr(self.model, "disable_adapter")
        if ref_model is None and not args.reference_free and not self.is_peft:
            ref_model = copy.deepcopy(unwrap(self.model))
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.ref_model = ref_model
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    @torch.no_grad()
    def reference_logps(self, model, batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if all(c in batch for c in REF_COLUMNS):
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.args.reference_free:
            return None, None
        if self.ref_model is not None:
            ctx, ref = contextlib.nullcontext(), self.ref_model.to(model.device)
        else:  # PEFT: the base weights with the adapter switched off are the reference
            ctx, ref = model.disable_adapter(), model
        with ctx:
            logps = sequence_logps(ref, batch, average=self.args.loss_type == "ipo",
                                   chunked=self.args.use_chunked_logprobs)
        return logps.chunk(2)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps = sequence_logps(model, inputs, average=self.args.loss_type == "ipo",
                               chunked=self.args.use_chunked_logprobs)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = self.reference_logps(model, inputs)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=self.args.beta, loss_type=self.args.loss_type,
            label_smoothing=self.args.label_smoothing, reference_free=self.args.reference_free)
        mode = "train" if model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        stats = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                 "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                 "rewards/margins": chosen_rewards - rejected_rewards,
                 "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
        for key, value in stats.items():
            self._metrics[mode][key].append(gather(value).mean().item())
        loss = losses.mean()
        return (loss, {"logps": logps}) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._metrics[mode].items():
            logs[f"{prefix}{key}"] = sum(values) / len(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)
