"""Kahneman-Tversky optimisation: `KTOTrainer` (a `transformers.Trainer`; config: `kto_config.py`).

Rows are prompt/completion/label (desirable or not; unpaired). Each batch's completion log-probs
under the policy and the reference, and the KL estimate from mismatched prompt/completion pairs of
the batch, feed `stages.losses.kto_loss` (`loss_type`) with `desirable_weight` / `undesirable_weight`.
With `precompute_ref_log_probs`, one reference pass before training stores each row's reference
log-probs and its KL pair's (REF_COLUMNS) and the reference model is dropped, as DPO does. The
details: docs/trainers.md.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
from transformers import Trainer

from stages.data.tokenize import tokenize_sft
from stages.losses import kto_loss
from stages.losses.preference import KTO_LOSSES_WITH_KL
from stages.precision import trainer_precision, use_fp32_cpu_attention
from stages.prompt_cache import continued_logps
from stages.sharding import unwrap
from stages.tensors import pad
from stages.trainers.eval_predictions import loss_and_predictions
from stages.trainers.inputs import apply_peft, disable_dropout, load_model, map_eval, offline_inputs
from stages.trainers.kto_config import KTOConfig  # noqa: F401 (the config of this trainer, re-exported)
from stages.trainers.method_fields import pad_multiple
from stages.trainers.model_options import router_aux_loss_coef, router_losses, with_router_loss
from stages.trainers.offloading import OffloadsActivations
from stages.trainers.pair_batches import flush_metrics, sequence_logps, tokenized_dataset
from stages.trainers.ref_sync import sync_reference
from stages.trainers.reference_model import (
    PrecomputedReference,
    frozen_reference,
    reference_model,
    reference_sequence_logps,
)

KL_PREFIX = "kl_"
REF_COLUMNS = ("ref_logps", "ref_kl_logps")  # precomputed reference log-probs (summed): the row's, its KL pair's


def tokenize_unpaired(tokenizer, rows: list[dict], max_length: int, *, start: int = 0, kl: bool = True
                      ) -> list[dict]:
    """Each prompt/completion/label row -> prompt_ids, completion_ids (truncated to max_length together), label,
    and with `kl` kl_completion_ids: the next row's completion (the last row's: the first's; `with_kl_pairs`
    does the same for a whole tokenised Dataset). `start`: the index of the first of `rows` in the whole dataset,
    for the messages."""
    bad = [i for i, r in enumerate(rows) if not isinstance(r.get("label"), bool)]
    if bad:
        raise ValueError(f"row {start + bad[0]}: label = {rows[bad[0]].get('label')!r}: KTO rows need label true "
                         f"(desirable) or false (undesirable) ({len(bad)} such row(s))")
    out = []
    for i, (r, t) in enumerate(zip(rows, tokenize_sft(tokenizer, rows, max_length=max_length), strict=True)):
        n_prompt = t["completion_mask"].index(1) if any(t["completion_mask"]) else len(t["input_ids"])
        if n_prompt == len(t["input_ids"]):
            raise ValueError(f"row {start + i}: the prompt fills max_length = {max_length}; nothing of the completion "
                             "is left (raise max_length or filter long prompts)")
        out.append({"prompt_ids": t["input_ids"][:n_prompt], "completion_ids": t["input_ids"][n_prompt:],
                    "label": r["label"]})
    if kl:
        for i, row in enumerate(out):  # the KL pair: this prompt with the next row's completion
            row["kl_completion_ids"] = out[(i + 1) % len(out)]["completion_ids"]
    return out


def with_kl_pairs(dataset):
    """A tokenised Dataset of unpaired rows plus kl_completion_ids: each row's completion_ids rolled by one row
    (the KL pair of `tokenize_unpaired`, across the whole dataset rather than one batch of it)."""
    import datasets
    import pyarrow as pa

    if not isinstance(dataset, datasets.Dataset) or "kl_completion_ids" in dataset.column_names or not len(dataset):
        return dataset
    column = dataset.data.column("completion_ids")
    rolled = pa.chunked_array(column.slice(1).chunks + column.slice(0, 1).chunks, type=column.type)
    return dataset.add_column("kl_completion_ids", rolled)


def check_labels(labels: list[bool], desirable_weight: float, undesirable_weight: float) -> None:
    """Error with one class only; warn when the weights miss the KTO paper's range for this class balance."""
    n_d = sum(labels)
    n_u = len(labels) - n_d
    if n_d == 0 or n_u == 0:
        raise ValueError(f"the KTO data has only {'undesirable' if n_d == 0 else 'desirable'} rows ({len(labels)}): "
                         "KTO needs both label true and label false rows; add the other class, or use SFT for "
                         "desirable-only data")
    ratio = desirable_weight * n_d / (undesirable_weight * n_u)
    if not 1 <= ratio <= 4 / 3:
        warnings.warn(
            f"kto: {n_d} desirable and {n_u} undesirable rows with desirable_weight = {desirable_weight}, "
            f"undesirable_weight = {undesirable_weight}: desirable_weight·n_desirable / (undesirable_weight·"
            f"n_undesirable) = {ratio:.3g}, outside [1, 4/3] (the KTO paper's recommendation); e.g. "
            f"desirable_weight = 1.0 with undesirable_weight in [{0.75 * n_d / n_u:.3g}, {n_d / n_u:.3g}], or "
            f"undesirable_weight = 1.0 with desirable_weight in [{n_u / n_d:.3g}, {4 / 3 * n_u / n_d:.3g}]",
            UserWarning, stacklevel=3)


@dataclass
class KTOCollator:
    """Features -> B matched rows (prompt i + completion i) and, under KL_PREFIX, B mismatched rows
    (prompt i + its `kl_completion_ids`) for the KL estimate; all 2B right-padded to one width, so that
    `_pairs` can stack them as the pairs (matched, mismatched) that share prompt i; `desirable`: (B,) bool; the
    REF_COLUMNS (B,) when the features have them."""

    pad_token_id: int
    max_length: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        pairs = [(f["prompt_ids"], f["completion_ids"]) for f in features]
        pairs += [(f["prompt_ids"], f["kl_completion_ids"]) for f in features]
        ids = [torch.tensor(p + c)[:self.max_length] for p, c in pairs]
        mask = [torch.tensor([0] * len(p) + [1] * len(c))[:self.max_length] for p, c in pairs]
        multiple = self.pad_to_multiple_of
        both = {"input_ids": pad(ids, padding_value=self.pad_token_id, pad_to_multiple_of=multiple),
                "attention_mask": pad([torch.ones_like(i) for i in ids], pad_to_multiple_of=multiple),
                "completion_mask": pad(mask, pad_to_multiple_of=multiple)}
        b = len(features)
        batch = {"desirable": torch.tensor([f["label"] for f in features])}
        for prefix, rows in (("", slice(0, b)), (KL_PREFIX, slice(b, 2 * b))):
            batch.update({f"{prefix}{k}": v[rows] for k, v in both.items()})
        for column in REF_COLUMNS:
            if column in features[0]:
                batch[column] = torch.tensor([f[column] for f in features], dtype=torch.float32)
        return batch


def _part(batch: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k: batch[prefix + k] for k in ("input_ids", "attention_mask", "completion_mask")}


def _pairs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The 2B rows matched then mismatched: pairs that share each prompt, in `PairCollator`'s layout, which
    `sequence_logps(pairs=True)` runs as B rows packed on the prompt (`stages.pair_packing`)."""
    matched, mismatched = _part(batch, ""), _part(batch, KL_PREFIX)
    return {k: torch.cat([matched[k], mismatched[k]]) for k in matched}


class KTOTrainer(PrecomputedReference, OffloadsActivations, Trainer):
    ref_columns = REF_COLUMNS
    loss_is_scaled_for_ga = False  # the loss is a mean over rows: Trainer divides by accumulation steps

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        args, train_dataset, eval_dataset, processing_class = offline_inputs(
            KTOConfig, "KTO", model, args, train_dataset, eval_dataset, processing_class)

        def prepare(rows):
            if rows is not None and not hasattr(rows, "__len__"):  # streamed: the KL pairs span the whole dataset
                rows = list(rows)
            return with_kl_pairs(tokenized_dataset(
                rows, "prompt_ids", partial(tokenize_unpaired, processing_class, max_length=args.max_length, kl=False),
                tokenizer=processing_class, num_proc=getattr(args, "dataset_num_proc", None)))

        train = prepare(train_dataset)  # data errors before any model is loaded
        check_labels(train["label"], args.desirable_weight, args.undesirable_weight)
        model = apply_peft(load_model(model, args, quantization_config), peft_config)
        if ref_model is not None:
            ref_model = load_model(ref_model, args)
        if args.disable_dropout:
            disable_dropout(model, ref_model)
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or KTOCollator(
            processing_class.pad_token_id, args.max_length, pad_multiple(args.pad_to_multiple_of)),
            processing_class=processing_class, train_dataset=train, eval_dataset=map_eval(eval_dataset, prepare),
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self.uses_kl = args.loss_type in KTO_LOSSES_WITH_KL
        if args.precompute_ref_log_probs and not self._has_ref_columns():
            self._precompute_reference(ref_model)
            ref_model = None  # dropped: the columns replace it
        self.ref_model = frozen_reference(self.model, ref_model, needed=not self._has_ref_columns())
        sync_reference(self)  # TR-DPO's reference syncing: sync_ref_model
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.router_aux_loss_coef = router_aux_loss_coef(unwrap(self.model), args.router_aux_loss_coef)

    @torch.no_grad()
    def _with_reference(self, data, ref, batch_size: int):
        if data is None or set(REF_COLUMNS) <= set(data.column_names):
            return data
        collate = KTOCollator(self.processing_class.pad_token_id, self.args.max_length)
        values: dict[str, list[float]] = {column: [] for column in REF_COLUMNS}
        with reference_model(self.model, ref, precision=trainer_precision(self.args)) as module:
            was_training = module.training
            module.eval()
            try:
                for start in range(0, len(data), batch_size):
                    batch = collate(data.select(range(start, min(start + batch_size, len(data)))).to_list())
                    batch = {k: v.to(self.args.device) for k, v in batch.items()}
                    for prefix, column in zip(("", KL_PREFIX), REF_COLUMNS, strict=True):
                        logps = reference_sequence_logps(module, _part(batch, prefix),
                                                         chunked=self.args.use_chunked_logprobs)
                        values[column] += logps.float().cpu().tolist()
            finally:
                module.train(was_training)
        data = data.remove_columns([c for c in REF_COLUMNS if c in data.column_names])
        for column in REF_COLUMNS:
            data = data.add_column(column, values[column])
        return data

    def _reference_logps(self, model, batch: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """Summed reference log-probs of the batch's matched ("") or KL ("kl_") rows: precomputed, else one
        reference forward."""
        column = REF_COLUMNS[0] if prefix == "" else REF_COLUMNS[1]
        if column in batch:
            return batch[column]
        with torch.no_grad(), reference_model(model, self.ref_model, precision=trainer_precision(self.args)) as ref:
            return reference_sequence_logps(ref, _part(batch, prefix), chunked=self.args.use_chunked_logprobs)

    @torch.no_grad()
    def kl_estimate(self, model, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Mean log-ratio policy / reference of the mismatched rows of `batches` on every process: a scalar."""
        chunked = self.args.use_chunked_logprobs
        ratios = []
        with self.compute_loss_context_manager():
            for batch in batches:
                kl_logps = sequence_logps(model, _part(batch, KL_PREFIX), chunked=chunked)
                ratios.append(kl_logps - self._reference_logps(model, batch, KL_PREFIX))
        return self._mean_over_processes(torch.cat(ratios))

    def _mean_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        total, rows = values.sum(), torch.tensor(float(values.numel()), device=values.device)
        if self.accelerator.num_processes > 1:
            total, rows = self.accelerator.reduce(total, "sum"), self.accelerator.reduce(rows, "sum")
        return total / rows.clamp(min=1)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The optimizer step's micro-batches; with more than one, each carries the step's one KL estimate
        ("kl"), computed here first. A step of one micro-batch gets it from the forwards of its loss instead
        (`compute_loss`): the same rows, the same value, no extra forward."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if len(batches) > 1 and self.uses_kl:
            kl = self.kl_estimate(self.model, batches)
            batches = [{**b, "kl": kl} for b in batches]
        return batches, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunked, moe = self.args.use_chunked_logprobs, self.router_aux_loss_coef > 0
        if not self.uses_kl or "kl" in inputs:  # no KL, or the step's KL came with the micro-batch
            with router_losses(model, moe) as aux:
                logps = sequence_logps(model, _part(inputs, ""), chunked=chunked)
            ref_logps = self._reference_logps(model, inputs, "")
            kl = inputs["kl"] if self.uses_kl else torch.zeros((), device=logps.device)
        else:  # matched and mismatched rows share their prompt: the policy runs the mismatched completions from the
            # matched forward's cached prompts (`stages.prompt_cache`), else packed on it; the reference packed
            rows, b = _pairs(inputs), inputs["desirable"].shape[0]
            cached = None if moe or not chunked else continued_logps(model, _part(inputs, ""),
                                                                      _part(inputs, KL_PREFIX))
            if cached is not None:
                both, aux = torch.cat(cached), []
            else:
                with router_losses(model, moe) as aux:  # a router loss counts every token: rows unpacked
                    both = sequence_logps(model, rows, chunked=chunked, pairs=not moe)
            if all(column in inputs for column in REF_COLUMNS):
                ref_both = torch.cat([inputs[column] for column in REF_COLUMNS])
            else:
                with torch.no_grad(), reference_model(model, self.ref_model,
                                                      precision=trainer_precision(self.args)) as ref:
                    ref_both = reference_sequence_logps(ref, rows, chunked=chunked, pairs=True)
            logps, ref_logps = both[:b], ref_both[:b]
            kl = self._mean_over_processes(both[b:].detach() - ref_both[b:])
        desirable = inputs["desirable"]
        losses = kto_loss(logps, ref_logps, kl, desirable, beta=self.args.beta, loss_type=self.args.loss_type,
                          desirable_weight=self.args.desirable_weight, undesirable_weight=self.args.undesirable_weight)
        self._record("train" if model.training else "eval", logps.detach(), ref_logps, kl, desirable)
        metrics: dict = {}
        loss = with_router_loss(losses.mean(), aux, self.router_aux_loss_coef, metrics)
        if metrics:
            self._metrics["train" if model.training else "eval"]["aux_loss"].append(
                self.accelerator.gather_for_metrics(metrics["aux_loss"]).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def _record(self, mode: str, logps, ref_logps, kl, desirable) -> None:
        gather = self.accelerator.gather_for_metrics
        logps, rewards, desirable = gather(logps), gather(self.args.beta * (logps - ref_logps)), gather(desirable)
        m = self._metrics[mode]
        if self.uses_kl:
            m["kl"].append(kl.item())  # the raw estimate; kto_loss clamps it at 0
        for name, select in (("chosen", desirable), ("rejected", ~desirable)):
            if select.any():  # a batch may hold one class only
                m[f"rewards/{name}"].append(rewards[select].mean().item())
                m[f"logps/{name}"].append(logps[select].mean().item())

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval: the loss, and for compute_metrics TRL's predictions: the policy's logits (B, T, V) of the batch's
        rows, with their input ids as label_ids (stages.trainers.eval_predictions)."""
        return loss_and_predictions(self, model, self._prepare_inputs(inputs), prediction_loss_only)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        flush_metrics(self._metrics[mode], logs, "eval_" if mode == "eval" else "")
        super().log(logs, start_time)
