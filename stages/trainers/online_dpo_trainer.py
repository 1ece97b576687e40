"""Online DPO: `OnlineDPOTrainer` (a `transformers.Trainer`; config: `online_dpo_config.py`).

Every optimizer step samples two completions per prompt from the current policy (`stages.generation`,
seeded from the run seed, the step and the prompt), ranks them with the reward functions (TRL's
`reward_funcs`; weights `reward_weights`), and trains on the pair with the same objectives as DPO
(`stages.losses.preference_loss`) against the reference (a frozen copy, or the adapter-disabled base
under PEFT). `missing_eos_penalty` lowers the score of completions cut before EOS; `beta` may change
per epoch (a list). Ties and unscored pairs get no loss. Evaluation samples and ranks pairs of the
`eval_dataset` prompts the same way (a fixed draw) and reports their loss and scores under `eval_`;
`compute_metrics` gets the pairs' logits (`stages.trainers.eval_predictions`). The details: docs/trainers.md.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers import Trainer

from stages.basics import stable_seed
from stages.generation.common import eos_token_ids
from stages.losses import preference_loss, resolve_objective
from stages.precision import trainer_precision, use_fp32_cpu_attention
from stages.reward_functions import build_reward_functions
from stages.sharding import unwrap
from stages.trainers.eval_predictions import EVAL_DRAW, PairPredictions, loss_and_predictions
from stages.trainers.inputs import (
    apply_peft,
    check_dataset,
    default_args,
    disable_dropout,
    load_model,
    load_processing_class,
    looks_like_rewards,
    map_eval,
    no_unknown_kwargs,
    renamed_kwarg,
    rows_with_prompts,
)
from stages.trainers.method_fields import beta_for_epoch
from stages.trainers.online_dpo_config import OnlineDPOConfig  # noqa: F401 (the config of this trainer, re-exported)
from stages.trainers.online_extras import render_prompts
from stages.trainers.online_generation import sample_online
from stages.trainers.pair_batches import PairCollator, completion_token_counts, flush_metrics, sequence_logps
from stages.trainers.reference_model import frozen_reference, reference_model, reference_sequence_logps
from stages.trainers.reward_mean import CheckpointsRewardMean, implicit_rewards, reward_mean_for


def rank_pairs(scores: list[float | None]) -> tuple[list[tuple[int, int]], int]:
    """Scores of 2P completions (two per prompt, prompt-major) -> [(chosen, rejected) indices], dropped count.

    A pair is dropped when its scores tie or either is None (no preference to learn).
    """
    pairs, dropped = [], 0
    for k in range(0, len(scores), 2):
        a, b = scores[k], scores[k + 1]
        if a is None or b is None or a == b:
            dropped += 1
        else:
            pairs.append((k, k + 1) if a > b else (k + 1, k))
    return pairs, dropped


def penalise_missing_eos(scores: list[float | None], has_eos: list[bool], penalty: float | None
                         ) -> list[float | None]:
    """Each score minus `penalty` where its completion has no EOS (None scores and a None penalty: unchanged)."""
    if penalty is None:
        return scores
    return [s if s is None or eos else s - penalty for s, eos in zip(scores, has_eos, strict=True)]


def pair_features(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int,
                  weight: float = 1.0) -> dict:
    """One prompt and two completions (token ids) -> the chosen_*/rejected_* features of `PairCollator`
    (weight 0: a dropped pair, which runs through the model but adds nothing to the loss)."""
    out = {"weight": weight}
    for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        tokens = (prompt_ids + ids)[:max_length]
        mask = ([0] * len(prompt_ids) + [1] * len(ids))[:max_length]
        if not any(mask):
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens fills max_length = {max_length}: nothing of its "
                             "completions is left (raise max_length or filter long prompts)")
        out.update({f"{side}_input_ids": tokens, f"{side}_completion_mask": mask})
    return out


class OnlineDPOTrainer(PairPredictions, CheckpointsRewardMean, Trainer):
    loss_is_scaled_for_ga = True  # a sum over the micro-batch's pairs / the whole step's pairs (see compute_loss)

    def __init__(self, model, ref_model=None, reward_funcs=None, args: OnlineDPOConfig | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, peft_config=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, **deprecated):
        reward_funcs = renamed_kwarg(deprecated, "reward_functions", "reward_funcs", reward_funcs,
                                     trainer="OnlineDPOTrainer")
        no_unknown_kwargs("OnlineDPOTrainer", deprecated)
        if looks_like_rewards(ref_model):
            raise TypeError(f"OnlineDPOTrainer: ref_model = {ref_model!r} looks like reward functions; the order is "
                            "TRL's, OnlineDPOTrainer(model, ref_model, reward_funcs, ...): pass reward_funcs=...")
        args = args or default_args(OnlineDPOConfig, model, "OnlineDPO")
        if reward_funcs is not None and args.reward_model_path is not None:
            raise ValueError(f"OnlineDPOTrainer: both reward_funcs and args.reward_model_path = "
                             f"{args.reward_model_path!r} given; pass one (the folder may go in reward_funcs too)")
        reward_funcs = reward_funcs if reward_funcs is not None else args.reward_model_path
        if reward_funcs is None:
            raise ValueError("OnlineDPOTrainer: reward_funcs is None; online DPO ranks its two samples with reward "
                             "functions: pass reward_funcs= (a callable, a list, a built-in name such as "
                             "'exact_match', or a reward model's folder), or set args.reward_model_path")
        rows = rows_with_prompts(train_dataset, "train_dataset", method="online DPO")
        eval_dataset = map_eval(check_dataset(eval_dataset, "eval_dataset", allow_dict=True), lambda data, name: (
            None if data is None else rows_with_prompts(data, name, method="online DPO")), named=True)
        if "inputs" in (getattr(args, "include_for_metrics", None) or []):
            raise ValueError(f"OnlineDPOConfig.include_for_metrics = {args.include_for_metrics}: 'inputs' is not "
                             "available: online DPO's evaluation batches are prompts, the pairs are sampled from "
                             "them; remove 'inputs' (compute_metrics gets the pairs' input ids as label_ids)")
        processing_class = load_processing_class(model, processing_class, args)
        model = apply_peft(load_model(model, args), peft_config)
        if ref_model is not None:
            ref_model = load_model(ref_model, args)
        if args.disable_dropout:
            disable_dropout(model, ref_model)
        self.reward_functions = build_reward_functions(reward_funcs, args.reward_weights, key="reward_funcs",
                                                       processing_classes=reward_processing_classes)
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or list,  # prompts pass through
                         processing_class=processing_class, train_dataset=rows, eval_dataset=eval_dataset,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self.objectives = [(name, resolve_objective(name)) for name in args.objective_names]
        self.loss_weights = args.loss_weights or [1.0] * len(self.objectives)
        self.ref_model = frozen_reference(self.model, ref_model)
        self.pair_collator = PairCollator(processing_class.pad_token_id)
        self.eos_ids = set(eos_token_ids(processing_class, unwrap(self.model)))
        self.reward_mean = reward_mean_for(args.objective_names)  # bco_pair's δ (stages.trainers.reward_mean)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The optimizer step's micro-batches of prompts -> pair batches, each carrying "step_pairs": the
        kept pairs of the whole step on every process (the loss's denominator)."""
        rows, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = [self.make_pairs(r) for r in rows]
        if batches:
            kept = sum(b["weight"].gt(0).sum() for b in batches).to(self.args.device).float()
            if self.accelerator.num_processes > 1:
                kept = self.accelerator.reduce(kept, "sum")
            batches = [{**b, "step_pairs": kept} for b in batches]
        return batches, num_items

    @torch.no_grad()
    def make_pairs(self, rows: list[dict], *, evaluation: bool = False) -> dict[str, torch.Tensor]:
        """Sample two completions per prompt, score and rank them: a `PairCollator` batch of one pair per
        prompt, "weight" 0 on the pairs dropped (tied or unscored). The samples' draw is the step's, or with
        `evaluation` the fixed EVAL_DRAW (evaluations then differ only by the policy); their scores go to that
        mode's metrics."""
        a, tok = self.args, self.processing_class
        prompts = [r["prompt"] for r in rows]
        rendered = render_prompts(tok, prompts, None, [r.get("tools") for r in rows])  # with each row's tools
        gens = sample_online(self.accelerator.unwrap_model(self.model), tok, rendered, a.sampling,
                             seed=stable_seed(a.seed, EVAL_DRAW if evaluation else self.state.global_step),
                             precision=trainer_precision(a))
        metrics = self._metrics["eval" if evaluation else "train"]
        index = gens.prompt_index
        scores, _ = self.reward_functions([prompts[i] for i in index], gens.completions, **gens.reward_columns(rows))
        scores = penalise_missing_eos(scores, [bool(self.eos_ids & set(ids)) for ids in gens.completion_ids],
                                      a.missing_eos_penalty)
        pairs, dropped = rank_pairs(scores)
        metrics["pairs/dropped"].append(dropped)
        scored = [v for v in scores if v is not None]
        if scored:
            metrics["scores/mean"].append(sum(scored) / len(scored))
        if pairs:
            metrics["scores/chosen"].append(sum(scores[c] for c, _ in pairs) / len(pairs))
            metrics["scores/rejected"].append(sum(scores[r] for _, r in pairs) / len(pairs))
        kept = dict(pairs)
        features = []
        for k in range(0, len(scores), 2):  # prompt-major: one pair per prompt, kept or weight 0
            c, r = (k, kept[k]) if k in kept else (k + 1, k) if k + 1 in kept else (k, k + 1)
            features.append(pair_features(gens.prompt_ids[index[c]], gens.completion_ids[c], gens.completion_ids[r],
                                          a.max_length, weight=1.0 if c in kept else 0.0))
        return {k: v.to(a.device) for k, v in self.pair_collator(features).items()}

    @property
    def beta(self) -> float:
        """β of the current epoch (`args.beta`, or its entry for this epoch when it is a list)."""
        return beta_for_epoch(self.args.beta, self.state.epoch or 0.0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunked = self.args.use_chunked_logprobs
        logps = sequence_logps(model, inputs, chunked=chunked, pairs=True)
        with reference_model(model, self.ref_model, precision=trainer_precision(self.args)) as ref:
            ref_chosen, ref_rejected = reference_sequence_logps(ref, inputs, chunked=chunked, pairs=True).chunk(2)
        weight = inputs["weight"]  # (B,): 0 for a tied or unscored pair (kept so every rank runs backward)
        bco_delta = None
        if self.reward_mean is not None:  # bco_pair's running δ over the kept pairs' implicit rewards
            if model.training:
                rewards = implicit_rewards(logps, ref_chosen, ref_rejected, self.beta)
                self.reward_mean.update(rewards[weight.repeat(2) > 0], self.accelerator.gather)
            bco_delta = self.reward_mean.value
        loss, stats = preference_loss(self.objectives, self.loss_weights, logps, completion_token_counts(inputs),
                                      ref_chosen, ref_rejected, weight=weight, beta=self.beta,
                                      bco_delta=bco_delta)
        stats["beta"] = torch.full_like(weight, self.beta)
        # mean x pairs = the sum over this micro-batch's kept pairs; x processes: DDP averages the gradients
        loss = loss * weight.numel() / inputs["step_pairs"].clamp(min=1) * self.accelerator.num_processes
        if "rewards/accuracies" in stats:
            stats["win_rate"] = stats.pop("rewards/accuracies")
        metrics = self._metrics["train" if model.training else "eval"]
        for key, value in stats.items():  # every rank gathers every key, kept pairs or not
            total, count = self.accelerator.gather(torch.stack([(value * weight).sum(), weight.sum()])[None]).sum(0)
            if count > 0:  # kept pairs on some rank: their mean; a dropped pair weighs nothing
                metrics[key].append((total / count).item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval on a batch of prompts: two samples each (`make_pairs`' evaluation draw), ranked by the reward
        functions; the loss is the mean over the kept pairs (NaN when none: left out of eval_loss), the
        predictions the pairs' logits (stages.trainers.eval_predictions)."""
        pairs = self.make_pairs(inputs, evaluation=True)
        kept = pairs["weight"].gt(0).sum().float()
        pairs["step_pairs"] = kept * self.accelerator.num_processes  # compute_loss: the mean over this batch's pairs
        loss, predictions, labels = loss_and_predictions(self, model, pairs, prediction_loss_only)
        return (loss if kept > 0 else torch.full_like(loss, math.nan)), predictions, labels

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        dropped = self._metrics[mode].pop("pairs/dropped", [])
        flush_metrics(self._metrics[mode], logs, prefix)
        if dropped or mode == "train":
            logs[f"{prefix}pairs/dropped"] = float(sum(dropped))
        super().log(logs, start_time)
