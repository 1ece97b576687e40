"""Online DPO: `OnlineDPOConfig` + `OnlineDPOTrainer` (a `transformers.Trainer`).

Rows are prompts (plus any columns the reward functions read, e.g. `answer`). Each training
step samples two completions per prompt from the current policy (`stages.generation.generate`),
scores both with the reward functions (`stages.rewards.RewardFunctions`), takes the higher-scored
one as chosen and the other as rejected, and applies the DPO loss to those fresh pairs, with the
same objectives, reference and loss path as `stages.trainers.dpo`. Pairs whose two scores tie
(identical samples, a binary reward both pass or fail) or that a reward left unscored (None)
carry no preference: they are dropped and counted.

`training_step` is the only override of the Trainer loop: it generates, builds the pair batch
and hands it to the usual step, whose `compute_loss` is the DPO one.

Logged: scores/mean (reward-function total of every sampled completion: what online training
raises), scores/chosen, scores/rejected (the same over the kept pairs),
win_rate (share of kept pairs whose implicit reward β·log(π/π_ref) already ranks the chosen
above the rejected), pairs/dropped (ties and unscored this log window), plus DPO's rewards/* and
logps/*.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from stages.rewards import build_reward_functions
from stages.trainers.dpo import (PairCollator, completion_token_counts, flush_metrics, frozen_reference,
                                 preference_loss, reference_model, reference_sequence_logps, sequence_logps)
from stages.trainers.objectives import OBJECTIVES, resolve_objective

GENERATION_BACKENDS = ("hf", "vllm")


@dataclass
class OnlineDPOConfig(TrainingArguments):
    beta: float = field(default=0.1, metadata={"help": "KL strength (> 0; 0.1 is typical)"})
    loss_type: str | list[str] = field(default="sigmoid", metadata={
        "help": f"objective(s) as in DPOConfig: {', '.join(OBJECTIVES)}, or 'package.module:function'"})
    loss_weights: list[float] | None = field(default=None, metadata={"help": "one weight per loss_type entry"})
    max_length: int = field(default=512, metadata={"help": "truncate prompt + completion to this many tokens"})
    max_new_tokens: int = field(default=64, metadata={"help": "generated tokens per completion at most"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (> 0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass in (0, 1]"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0: off)"})
    generation_backend: str = field(default="hf", metadata={"help": "hf (in-process) or vllm"})
    generation_batch_size: int = field(default=64, metadata={"help": "prompts per generate call"})
    generation_kwargs: dict | None = field(default=None, metadata={"help": "backend options (vllm: model, base_url)"})
    use_chunked_logprobs: bool = field(default=True, metadata={"help": "log-probs without full logits if possible"})

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.beta <= 0:
            problems.append(f"beta = {self.beta}: must be > 0 (the KL strength; 0.1 is typical)")
        names = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        for i, name in enumerate(names):
            try:
                resolve_objective(name)
            except ValueError as e:
                problems.append(f"loss_type = {e}" if isinstance(self.loss_type, str) else f"loss_type[{i}] = {e}")
        if self.loss_weights is not None and len(self.loss_weights) != len(names):
            problems.append(f"loss_weights = {self.loss_weights}: one weight per loss_type entry ({len(names)})")
        if self.temperature <= 0:
            problems.append(f"temperature = {self.temperature}: must be > 0 (online DPO samples; 1.0 is typical)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p = {self.top_p}: must be in (0, 1] (1.0 = off)")
        if self.max_new_tokens < 1 or self.generation_batch_size < 1 or self.top_k < 0:
            problems.append(f"max_new_tokens = {self.max_new_tokens}, generation_batch_size = "
                            f"{self.generation_batch_size}, top_k = {self.top_k}: must be >= 1, >= 1, >= 0")
        if self.generation_backend not in GENERATION_BACKENDS:
            problems.append(f"generation_backend = {self.generation_backend!r}: supported: "
                            f"{', '.join(GENERATION_BACKENDS)}")
        elif self.generation_backend == "vllm" and "model" not in (self.generation_kwargs or {}):
            problems.append("generation_backend = 'vllm' needs generation_kwargs = {'model': <the served model>, "
                            "'base_url': ...}; the server's weights are not synced from the trainer")
        if problems:
            raise ValueError("online DPO config: " + "; ".join(problems))


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


def pair_features(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int) -> dict:
    """One prompt and two completions (token ids) -> the chosen_*/rejected_* features of `PairCollator`."""
    out = {}
    for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        tokens = (prompt_ids + ids)[:max_length]
        mask = ([0] * len(prompt_ids) + [1] * len(ids))[:max_length]
        if not any(mask):
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens fills max_length = {max_length}: nothing of its "
                             "completions is left (raise max_length or filter long prompts)")
        out.update({f"{side}_input_ids": tokens, f"{side}_completion_mask": mask})
    return out


class OnlineDPOTrainer(Trainer):
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs: Trainer divides by accumulation steps

    def __init__(self, model, reward_functions, ref_model=None, *, args: OnlineDPOConfig, processing_class,
                 train_dataset, **kwargs):
        rows = list(train_dataset)
        missing = [i for i, r in enumerate(rows) if "prompt" not in r]
        if not rows or missing:
            raise ValueError(f"train_dataset: online DPO needs rows with a 'prompt' column; {len(missing)} of "
                             f"{len(rows)} rows lack it (first: row {missing[0] if missing else '-'})")
        if kwargs.get("eval_dataset") is not None:
            raise ValueError("eval_dataset: online DPO has no offline evaluation loss; evaluate the saved model "
                             "(stage evaluate) instead")
        self.reward_functions = build_reward_functions(reward_functions)
        args.remove_unused_columns = False
        kwargs.setdefault("data_collator", list)  # rows pass through; prompts are rendered by the generator
        super().__init__(model=model, args=args, processing_class=processing_class, train_dataset=rows, **kwargs)
        names = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
        self.objectives = [(name, resolve_objective(name)) for name in names]
        self.loss_weights = args.loss_weights or [1.0] * len(names)
        self.ref_model = frozen_reference(self.model, ref_model)
        self.pair_collator = PairCollator(processing_class.pad_token_id)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._generations = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        batch = self.make_pairs(inputs)
        if batch is None:  # every pair tied: nothing to learn; the step logs loss 0 (see pairs/dropped)
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, batch, num_items_in_batch)

    @torch.no_grad()
    def make_pairs(self, rows: list[dict]) -> dict[str, torch.Tensor] | None:
        """Sample two completions per prompt, score and rank them: a `PairCollator` batch, or None."""
        from stages.generation import SamplingParams, sample_policy

        a, tok = self.args, self.processing_class
        prompts = [r["prompt"] for r in rows]
        sampling = SamplingParams(max_new_tokens=a.max_new_tokens, n=2, do_sample=True, temperature=a.temperature,
                                  top_p=a.top_p, top_k=a.top_k,
                                  seed=a.seed + 100_003 * self._generations + a.process_index)
        self._generations += 1
        gens = sample_policy(self.accelerator.unwrap_model(self.model), tok, prompts, sampling,
                             backend=a.generation_backend, batch_size=a.generation_batch_size,
                             options=a.generation_kwargs)
        index = gens.prompt_index
        scores, _ = self.reward_functions([prompts[i] for i in index], gens.completions, **gens.reward_columns(rows))
        pairs, dropped = rank_pairs(scores)
        self._metrics["pairs/dropped"].append(dropped)
        scored = [v for v in scores if v is not None]
        if scored:
            self._metrics["scores/mean"].append(sum(scored) / len(scored))
        if not pairs:
            return None
        self._metrics["scores/chosen"].append(sum(scores[c] for c, _ in pairs) / len(pairs))
        self._metrics["scores/rejected"].append(sum(scores[r] for _, r in pairs) / len(pairs))
        features = [pair_features(gens.prompt_ids[index[c]], gens.completion_ids[c], gens.completion_ids[r],
                                  a.max_length) for c, r in pairs]
        return self.pair_collator(features)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunked = self.args.use_chunked_logprobs
        logps = sequence_logps(model, inputs, chunked=chunked)
        with reference_model(model, self.ref_model) as ref:
            ref_chosen, ref_rejected = reference_sequence_logps(ref, inputs, chunked=chunked).chunk(2)
        loss, stats = preference_loss(self.objectives, self.loss_weights, logps, completion_token_counts(inputs),
                                      ref_chosen, ref_rejected, beta=self.args.beta)
        if "rewards/accuracies" in stats:
            stats["win_rate"] = stats.pop("rewards/accuracies")
        for key, value in stats.items():
            self._metrics[key].append(self.accelerator.gather_for_metrics(value).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        dropped = self._metrics.pop("pairs/dropped", [])
        flush_metrics(self._metrics, logs)
        logs["pairs/dropped"] = float(sum(dropped))
        super().log(logs, start_time)
