"""REINFORCE leave-one-out: `RLOOTrainer` (a `transformers.Trainer`; config: `rloo_config.py`).

Every generation (`steps_per_generation` micro-batches; by default one optimizer step's) samples
`num_generations` completions per prompt from the policy, scores them
with the reward functions, and trains on `stages.losses.rloo_loss` with the advantages of
`stages.losses.rloo_advantages`: each completion's reward minus the mean reward of the prompt's
other completions. With `beta` > 0 the KL to the reference is part of the reward (beta x the
completion's summed log-ratio π_old / π_ref), not of the loss; the importance ratio is one per
sequence. The mechanics (sampling every micro-batch of a generation at once, reuse for `num_iterations`
updates and across optimizer steps, scoring, timing and checkpointed rollouts) are GRPOTrainer's; this class
replaces what RLOO does differently: the rollout batch's advantages and the loss.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from transformers import Trainer

from stages.basics import stable_seed
from stages.losses import rloo_advantages, rloo_loss
from stages.precision import trainer_precision
from stages.trainers.grpo_trainer import GRPOTrainer, completion_tensors, per_token_logps
from stages.trainers.inputs import check_dataset, default_args
from stages.trainers.model_options import with_router_loss
from stages.trainers.online_extras import (
    completion_sample,
    log_completion_sample,
    pad_to_multiple,
    render_prompts,
)
from stages.trainers.online_generation import sample_online
from stages.trainers.reference_model import reference_model
from stages.trainers.rloo_config import RLOOConfig
from stages.trainers.rollout import completion_logps


def clip_range(value: list[float] | None) -> tuple[float, float] | None:
    """reward_clip_range as (min, max) (params.yaml gives it as a list)."""
    return None if value is None else (float(value[0]), float(value[1]))


class RLOOTrainer(GRPOTrainer):
    args: RLOOConfig  # the config this trainer is built with (TrainingArguments to transformers)
    processing_class: Any  # a tokenizer (transformers types it as any processor)
    train_dataset: Any  # the prompt rows, a list
    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, *, data_collator=None):
        if reward_funcs is None:
            raise ValueError("RLOOTrainer: reward_funcs is None; RLOO needs at least one reward function (a callable, "
                             "a list, a built-in name such as 'exact_match', or a reward model's folder)")
        args = args or default_args(RLOOConfig, model, "RLOO")
        if not isinstance(args, RLOOConfig):
            raise TypeError(f"args is a {type(args).__name__}: RLOOTrainer takes an RLOOConfig")
        super().__init__(model, reward_funcs, args, train_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config,
                         data_collator=data_collator)
        self.eval_rows = None if eval_dataset is None else list(check_dataset(eval_dataset, "eval_dataset"))
        if self.eval_rows is not None and not all("prompt" in r for r in self.eval_rows):
            raise ValueError("eval_dataset: RLOO evaluates on rows with a 'prompt' column (and the columns its reward "
                             "functions read); some rows lack it")

    @torch.no_grad()
    def make_batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Generate and score one micro-batch; its leave-one-out advantages (and old log-probs when reused)."""
        from stages.generation.common import eos_token_ids

        a, tok = self.args, self.processing_class
        policy = self.accelerator.unwrap_model(self.model)
        prompts = [r["prompt"] for r in rows]
        start = time.perf_counter()
        rendered = render_prompts(tok, prompts, a.chat_template_kwargs, [r.get("tools") for r in rows])
        gens = sample_online(policy, tok, rendered, a.sampling,
                             seed=stable_seed(a.seed, self.state.global_step), precision=trainer_precision(a))
        self._tick("generation_s", time.perf_counter() - start)

        start = time.perf_counter()
        eos = eos_token_ids(tok, policy)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        batch = completion_tensors([gens.prompt_ids[i] for i in gens.prompt_index], gens.completion_ids,
                                   eos_token_id=eos, pad_token_id=pad_id)
        batch = {k: v.to(a.device) for k, v in pad_to_multiple(batch, a.pad_to_multiple_of, pad_id).items()}
        prompts = [prompts[i] for i in gens.prompt_index]
        totals, per_function = self.score(prompts, gens.completions, gens.reward_columns(rows), batch)
        self._tick("scoring_s", time.perf_counter() - start)

        start = time.perf_counter()
        valid = torch.tensor([t is not None for t in totals], device=a.device)
        rewards = torch.tensor([math.nan if t is None else t for t in totals], dtype=torch.float32, device=a.device)
        temperature, chunked, mask = a.sampling.temperature, a.use_chunked_logprobs, batch["completion_mask"]
        # reused rollouts (num_iterations > 1, or a generation that outlasts its optimizer step) need the ratio's
        # denominator; beta > 0 the KL's policy side
        reused = a.num_iterations > 1 or a.resolved_steps_per_generation > a.gradient_accumulation_steps
        if reused or a.beta > 0:
            old, _ = per_token_logps(self.model, batch, temperature=temperature, chunked=chunked)
            if reused:
                batch["old_logps"] = old
        kl = None
        if a.beta > 0:
            with reference_model(self.model, self.ref_model, precision=trainer_precision(a)) as ref:
                ref_logps, _ = per_token_logps(ref, batch, temperature=temperature, chunked=chunked)
            kl = ((old - ref_logps) * mask).sum(dim=1)
            self._metrics["kl"].append((kl.sum() / mask.sum().clamp(min=1)).item())
        batch["advantages"] = rloo_advantages(rewards, a.num_generations, valid=valid, kl=kl, beta=a.beta,
                                              reward_clip_range=clip_range(a.reward_clip_range),
                                              normalize=a.normalize_advantages).float()
        loss_mask = mask * valid[:, None]
        if a.mask_truncated_completions:
            loss_mask = loss_mask * ~batch["truncated"][:, None]
        batch["loss_mask"] = loss_mask
        self._tick("training_s", time.perf_counter() - start)
        self._log_generation(rewards, valid, per_function, batch)
        if a.log_completions and self.state.global_step % max(int(a.logging_steps), 1) == 0:
            log_completion_sample(completion_sample(prompts, gens.completions, totals,
                                                    limit=a.num_completions_to_print,
                                                    unique_prompts=a.log_unique_prompts), self.state.global_step)
        return batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        a = self.args
        out = completion_logps(model, inputs, temperature=a.sampling.temperature, chunked=a.use_chunked_logprobs,
                               with_entropy=True, with_aux_loss=self.router_aux_loss_coef > 0)
        logps, entropy, mask = out["logps"], out["entropy"].detach(), inputs["loss_mask"]
        loss, metrics = rloo_loss(logps, inputs.get("old_logps"), inputs["advantages"], mask,
                                  epsilon_low=a.epsilon, epsilon_high=a.epsilon_high)
        loss = with_router_loss(loss, [out["aux_loss"]] if "aux_loss" in out else [], self.router_aux_loss_coef,
                                metrics)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        for key, value in metrics.items():
            value = torch.as_tensor(value, device=loss.device).detach().float()
            self._metrics[key].append(self.accelerator.gather_for_metrics(value).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss


    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The policy's mean reward on the eval prompts: num_generations_eval (else num_generations) sampled
        completions per prompt, seeded from the run seed and the step, scored by the reward functions."""
        rows = list(check_dataset(eval_dataset, "eval_dataset")) if eval_dataset is not None else self.eval_rows
        if not rows:
            raise ValueError("RLOOTrainer.evaluate: no eval_dataset (pass one to the trainer or to evaluate)")
        a, tok = self.args, self.processing_class
        sampling = dataclasses.replace(a.sampling, n=a.num_generations_eval or a.num_generations)
        policy = self.accelerator.unwrap_model(self.model)
        totals: list[float | None] = []
        functions: dict[str, list[float]] = {}
        size = max(a.per_device_eval_batch_size, 1)
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            prompts = [r["prompt"] for r in chunk]
            rendered = render_prompts(tok, prompts, a.chat_template_kwargs, [r.get("tools") for r in chunk])
            gens = sample_online(policy, tok, rendered, sampling,
                                 seed=stable_seed(a.seed, self.state.global_step, 1),  # not a training draw
                                 precision=trainer_precision(a))
            assert self.reward_functions is not None  # RLOO always has reward functions (checked in __init__)
            scores, per_function = self.reward_functions([prompts[i] for i in gens.prompt_index], gens.completions,
                                                         **gens.reward_columns(chunk))
            totals += scores
            for name, values in per_function.items():
                functions.setdefault(name, []).extend(v for v in values if v is not None)
        scored = [t for t in totals if t is not None]
        metrics = {f"{metric_key_prefix}_reward": sum(scored) / len(scored) if scored else math.nan,
                   f"{metric_key_prefix}_frac_reward_none": 1 - len(scored) / max(len(totals), 1)}
        metrics.update({f"{metric_key_prefix}_rewards/{k}/mean": sum(v) / len(v) for k, v in functions.items() if v})
        Trainer.log(self, metrics)  # GRPOTrainer.log would flush the training window's metrics into this entry
        return metrics


__all__ = ["RLOOConfig", "RLOOTrainer"]
