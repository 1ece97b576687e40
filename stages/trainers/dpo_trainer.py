"""Direct preference optimisation: `DPOTrainer` (a `transformers.Trainer`; config: `dpo_config.py`).

Rows are prompt/chosen/rejected (strings or chat messages; TRL's implicit-prompt rows too). Chosen and
rejected go through the model in one forward of 2B rows; their summed completion log-probs feed the
objectives named by `loss_type` (`stages.losses.preference_loss`: the DPO variants, "sft", or your own
by dotted path, combined with `loss_weights`). The reference is a frozen copy of the starting model,
the same weights with the adapter disabled under PEFT, none with `reference_free`, or precomputed
`ref_chosen_logps` / `ref_rejected_logps` columns (`precompute_ref_log_probs`; summed log-probs, so one
pass serves every loss type). `ld_alpha` (LD-DPO) scales the tokens past each pair's shared length in
both the policy's and the reference's sums; `use_weighting` (WPO) scales each pair by the policy's
length-normalised probability of its two completions (`stages.losses.pair_length`).
Optional `weight` / `task` columns and `task_weights` scale pairs;
`balance_column` draws balanced batches. The details: docs/trainers.md.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from functools import partial

import torch
from transformers import Trainer

from stages.logprobs import CausalLM, causal_lm
from stages.losses import preference_loss, resolve_objective
from stages.losses.pair_length import ld_logps, wpo_weights
from stages.precision import trainer_precision, use_fp32_cpu_attention
from stages.sharding import unwrap
from stages.trainers.balanced_sampler import BalancedBatchSampler, FlatSampler
from stages.trainers.dpo_config import DPOConfig  # noqa: F401 (the config of this trainer, re-exported)
from stages.trainers.eval_predictions import PairPredictions, loss_and_predictions
from stages.trainers.inputs import apply_peft, disable_dropout, load_model, map_eval, offline_inputs
from stages.trainers.method_fields import pad_multiple
from stages.trainers.model_options import router_aux_loss_coef, router_losses, with_router_loss
from stages.trainers.offloading import OffloadsActivations
from stages.trainers.pair_batches import (
    REF_COLUMNS,
    PairCollator,
    completion_token_counts,
    flush_metrics,
    token_logps,
    tokenize_pairs,
    tokenized_dataset,
)
from stages.trainers.ref_sync import sync_reference
from stages.trainers.reference_model import (
    PrecomputedReference,
    frozen_reference,
    precomputed,
    reference_logps_table,
    reference_model,
    reference_sequence_logps,
)
from stages.trainers.reward_mean import CheckpointsRewardMean, implicit_rewards, reward_mean_for

BALANCE_KEY = "balance_key"  # the balance column's value per row, as a JSON string


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



class DPOTrainer(PairPredictions, PrecomputedReference, CheckpointsRewardMean, OffloadsActivations, Trainer):
    ref_columns = REF_COLUMNS
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        args, train_dataset, eval_dataset, processing_class = offline_inputs(
            DPOConfig, "DPO", model, args, train_dataset, eval_dataset, processing_class)
        model = apply_peft(load_model(model, args, quantization_config), peft_config)
        if ref_model is not None:
            ref_model = load_model(ref_model, args)
        if args.disable_dropout:
            disable_dropout(model, ref_model)

        def prepare(rows):
            if rows is not None:
                rows = with_balance_key(pair_weights(list(rows), args.task_weights), args.balance_column)
            return tokenized_dataset(rows, "chosen_input_ids", partial(tokenize_pairs, processing_class,
                                                                       max_length=args.max_length, keep=(BALANCE_KEY,)),
                                     tokenizer=processing_class, num_proc=getattr(args, "dataset_num_proc", None))

        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or PairCollator(
            processing_class.pad_token_id, pad_multiple(args.pad_to_multiple_of)), processing_class=processing_class,
            train_dataset=prepare(train_dataset),
            eval_dataset=map_eval(eval_dataset, prepare), compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers)
        self.objectives = [(name, resolve_objective(name)) for name in args.objective_names]
        self.loss_weights = args.loss_weights or [1.0] * len(self.objectives)
        if args.precompute_ref_log_probs and not args.reference_free and not self._has_ref_columns():
            self._precompute_reference(ref_model)
            ref_model = None  # dropped: the columns replace it
        self.ref_model = frozen_reference(self.model, ref_model,
                                          needed=not args.reference_free and not self._has_ref_columns())
        sync_reference(self)  # TR-DPO: sync_ref_model
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.reward_mean = reward_mean_for(args.objective_names)  # bco_pair's δ, kept across steps and checkpoints
        self.router_aux_loss_coef = router_aux_loss_coef(unwrap(self.model), args.router_aux_loss_coef)
        if args.padding_free and self.router_aux_loss_coef > 0:
            raise ValueError(f"padding_free = True with a router loss (router_aux_loss_coef = "
                             f"{self.router_aux_loss_coef}): the load-balancing loss reads a 2D attention mask, "
                             "which the joined row replaces; set padding_free: false or router_aux_loss_coef: 0")

    def _with_reference(self, data, ref, batch_size: int):
        if data is None or set(REF_COLUMNS) <= set(data.column_names):
            return data
        with reference_model(self.model, ref, precision=trainer_precision(self.args)) as module:
            logps = reference_logps_table(
                module, self.processing_class, data.to_list(), max_length=self.args.max_length,
                batch_size=batch_size, device=self.args.device,
                chunked=self.args.use_chunked_logprobs, ld_alpha=self.args.ld_alpha)
        data = data.remove_columns([c for c in REF_COLUMNS if c in data.column_names])
        for j, col in enumerate(REF_COLUMNS):
            data = data.add_column(col, logps[:, j].tolist())
        return data

    def _get_train_sampler(self, train_dataset=None):
        if self.args.balance_column is None:
            return super()._get_train_sampler(train_dataset)
        data = train_dataset if train_dataset is not None else self.train_dataset
        return FlatSampler(BalancedBatchSampler(data[BALANCE_KEY], self._train_batch_size, seed=self.args.seed))

    def reference_logps(self, lm: CausalLM, batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Summed reference log-probs of the chosen and rejected completions: (B,) each."""
        columns = precomputed(batch)
        if columns is not None:
            return columns
        if self.args.reference_free:
            return None, None
        with reference_model(lm, self.ref_model, precision=trainer_precision(self.args)) as ref:
            return reference_sequence_logps(ref, batch, chunked=self.args.use_chunked_logprobs, pairs=True,
                                            ld_alpha=self.args.ld_alpha, padding_free=self.args.padding_free
                                            ).chunk(2)

    def policy_logps(self, lm: CausalLM, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's summed completion log-probs, (2B,) (LD-DPO's with `ld_alpha`), and the pair weights, (B,)
        or None: the `weight` column times WPO's weights with `use_weighting`."""
        weight = inputs.get("weight")
        # a router loss counts every token of the forward: the pair's rows as they are, not packed on their prefix
        aux = self.router_aux_loss_coef > 0
        per_token, sum_sq = token_logps(lm, inputs, chunked=self.args.use_chunked_logprobs, pairs=not aux,
                                        sum_sq=self.args.use_weighting, padding_free=self.args.padding_free)
        mask = inputs["completion_mask"][:, 1:]
        logps = per_token.sum(-1) if self.args.ld_alpha is None else ld_logps(per_token, mask, self.args.ld_alpha)
        if sum_sq is not None:
            wpo = wpo_weights(per_token, sum_sq, mask)
            self._metrics["train" if lm.model.training else "eval"]["wpo_weight"].append(
                self.accelerator.gather_for_metrics(wpo).mean().item())
            weight = wpo if weight is None else weight * wpo
        return logps, weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        lm = causal_lm(model)  # unwrapped once: what the packing, the forward and the head need (stages.logprobs)
        with router_losses(model, self.router_aux_loss_coef > 0) as aux:
            logps, weight = self.policy_logps(lm, inputs)
        ref_chosen, ref_rejected = self.reference_logps(lm, inputs)
        bco_delta = None
        if self.reward_mean is not None:
            if model.training:
                self.reward_mean.update(implicit_rewards(logps, ref_chosen, ref_rejected, self.args.beta),
                                        self.accelerator.gather)
            bco_delta = self.reward_mean.value
        loss, stats = preference_loss(self.objectives, self.loss_weights, logps, completion_token_counts(inputs),
                                      ref_chosen, ref_rejected, weight=weight, beta=self.args.beta,
                                      label_smoothing=self.args.label_smoothing,
                                      reference_free=self.args.reference_free, bco_delta=bco_delta,
                                      discopop_tau=self.args.discopop_tau,
                                      f_divergence_type=self.args.f_divergence_type,
                                      f_alpha_divergence_coef=self.args.f_alpha_divergence_coef)
        loss = with_router_loss(loss, aux, self.router_aux_loss_coef, stats)
        mode = "train" if model.training else "eval"
        for key, value in stats.items():
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval: the loss, and for compute_metrics TRL's predictions: the policy's logits (2B, T, V) of the chosen
        then rejected rows, with their input ids as label_ids (stages.trainers.eval_predictions)."""
        return loss_and_predictions(self, model, self._prepare_inputs(inputs), prediction_loss_only)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        flush_metrics(self._metrics[mode], logs, "eval_" if mode == "eval" else "")
        super().log(logs, start_time)
