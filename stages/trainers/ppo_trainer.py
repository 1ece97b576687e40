"""Proximal policy optimisation with a learned value baseline: `PPOTrainer` (config: `ppo_config.py`).

One Trainer step = one rollout batch and its PPO epochs: sample one completion per prompt from the
current policy and score it (`stages.reward_functions`; offline: rows that already hold a score), compute
per-token log-probs under the policy and the reference and values V(s_t), per-token rewards
(-kl_coef·KL plus the score at the last token, `stages.losses.per_token_rewards`), advantages by
GAE (`stages.losses.gae`, whitened over the batch on every process), then `num_ppo_epochs` passes of
`num_mini_batches` optimizer steps on `stages.losses.ppo_loss`. Policy and critic share one trunk
(`AutoModelForCausalLMWithValueHead`). Masks come from lengths and EOS positions, never `ids != pad`;
unscored completions are masked out. The details: docs/trainers.md.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from stages.basics import stable_seed
from stages.data.tokenize import tokenize_sft
from stages.losses import (
    explained_variance,
    gae,
    masked_whiten,
    per_token_rewards,
    ppo_loss,
    truncated_importance_weights,
)
from stages.precision import trainer_precision, use_fp32_cpu_attention
from stages.reward_functions import build_reward_functions
from stages.sharding import unwrap
from stages.trainers.inputs import apply_peft, check_dataset, default_args, load_model, load_processing_class
from stages.trainers.off_policy import OffPolicyWarning
from stages.trainers.online_generation import sample_online
from stages.trainers.ppo_config import PPOConfig  # noqa: F401 (the config of this trainer, re-exported)
from stages.trainers.reference_model import frozen_reference, reference_model
from stages.trainers.rollout import completion_logps, pad_rollout, sampler_logps
from stages.trainers.value_head import AutoModelForCausalLMWithValueHead, PreTrainedModelWrapper

# ------------------------------------------------------------------------------------ rows


def _keep_rows(features: list[dict]) -> list[dict]:
    return features  # the trainer tokenises (offline) or generates (online) itself


def check_rows(rows: list[dict], *, online: bool) -> None:
    """Clear errors before the first step: a prompt in every row; offline, a completion and a finite score."""
    if not rows:
        raise ValueError("train_dataset is empty: PPO needs prompts (online) or prompt/completion/score rows (offline)")
    need = ("prompt",) if online else ("prompt", "completion", "score")
    for i, row in enumerate(rows):
        missing = [c for c in need if c not in row or row[c] is None]
        if missing and online:
            raise ValueError(f"train_dataset row {i} has no {missing[0]!r}: online PPO needs a prompt per row")
        if missing:
            how = ("no reward functions were given, so PPO runs offline on precomputed scores: add a numeric 'score' "
                   "to every row, or pass reward_funcs= (rule names such as 'exact_match', a reward model, "
                   "callables) to score fresh samples")
            raise ValueError(f"train_dataset row {i} has no {missing[0]!r} column: {how}")
        if not online and not (isinstance(row["score"], (int, float)) and math.isfinite(row["score"])):
            raise ValueError(f"train_dataset row {i}: score = {row['score']!r}; must be a finite number")


def offline_samples(tokenizer, rows: list[dict], max_new_tokens: int) -> tuple[list, list, list[float]]:
    """prompt_ids, completion_ids (EOS appended, cut to max_new_tokens) and scores of prompt/completion/score rows."""
    toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r["completion"], "tools": r.get("tools")}
                                    for r in rows])
    prompt_ids, completion_ids = [], []
    for t in toks:
        start = t["completion_mask"].index(1) if 1 in t["completion_mask"] else len(t["input_ids"])
        prompt_ids.append(t["input_ids"][:start])
        completion_ids.append(t["input_ids"][start:start + max_new_tokens])
    return prompt_ids, completion_ids, [float(r["score"]) for r in rows]


# ------------------------------------------------------------------------------------ trainer


class PPOTrainer(OffPolicyWarning, Trainer):
    """PPO on prompts (online, with reward_funcs) or on prompt/completion/score rows (offline).

    model: an `AutoModelForCausalLMWithValueHead`, or a causal LM / PEFT model, which gets a
    fresh value head here. ref_model: the frozen reference LM (default: a copy of the starting
    LM; none needed under PEFT). reward_funcs: see `stages.reward_functions.build_reward_functions`; None means offline.
    """

    def __init__(self, model, ref_model=None, *, args: PPOConfig | None = None, processing_class=None,
                 train_dataset=None, reward_funcs=None, data_collator=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        import datasets

        args = args or default_args(PPOConfig, model, "PPO")
        rows = list(check_dataset(train_dataset, "train_dataset") or [])
        self.online = reward_funcs is not None
        check_rows(rows, online=self.online)
        self.reward_fn = build_reward_functions(reward_funcs, args.reward_weights, key="reward_funcs") \
            if self.online else None
        processing_class = load_processing_class(model, processing_class, args)
        if not isinstance(model, PreTrainedModelWrapper):
            model = apply_peft(load_model(model, args, quantization_config), peft_config)
        elif peft_config is not None:
            raise ValueError("peft_config given with a model that already has its value head; pass the causal LM "
                             "(or its folder) with peft_config, and PPOTrainer adds the head")
        if ref_model is not None:
            ref_model = load_model(ref_model, args)
        if not isinstance(model, PreTrainedModelWrapper):
            model = AutoModelForCausalLMWithValueHead(model)
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        args.remove_unused_columns = False
        if args.ddp_find_unused_parameters is None:
            # every trainable weight gets a gradient; DDP's search for unused ones would mark the LM head
            # "unused" (chunked log-probs read it outside the forward) and then fail when its gradient arrives
            args.ddp_find_unused_parameters = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or _keep_rows,
                         processing_class=processing_class, train_dataset=datasets.Dataset.from_list(rows),
                         callbacks=callbacks, optimizers=optimizers)
        from stages.generation.common import eos_token_ids

        self.eos_ids = eos_token_ids(processing_class, model.pretrained_model)
        self.pad_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else self.eos_ids[0]
        self.ref_model = frozen_reference(model.pretrained_model, ref_model)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ---- one step: rollout, then the PPO epochs

    def training_step(self, model, inputs: list[dict], num_items_in_batch=None) -> torch.Tensor:
        model.train()
        rollout = self.rollout(model, inputs)
        a = self.args
        total = a.num_ppo_epochs * a.num_mini_batches
        losses = []
        for step in range(total):
            if step % a.num_mini_batches == 0:  # a new epoch: a new shuffle
                minibatches = torch.randperm(len(inputs), device=a.device).tensor_split(a.num_mini_batches)
            loss = self.minibatch_loss(model, rollout, minibatches[step % a.num_mini_batches])
            self.accelerator.backward(loss)
            losses.append(loss.detach())
            if step < total - 1:  # the last step is the Trainer's own, after we return
                self._optimizer_step(model)
        return torch.stack(losses).mean().to(a.device)

    def _optimizer_step(self, model) -> None:
        if self.args.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def sum_over_processes(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the data-parallel processes (each holds a shard of the rollout batch)."""
        return self.accelerator.reduce(x, reduction="sum") if self.accelerator.num_processes > 1 else x

    def minibatch_loss(self, model, rollout: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        mb = {k: v[idx] for k, v in rollout.items()}
        # the mean over the whole minibatch's tokens on every process (DDP averages the gradients)
        num_tokens = self.sum_over_processes(mb["completion_mask"].sum().float()).clamp(min=1) \
            / self.accelerator.num_processes
        with self.compute_loss_context_manager():
            out = completion_logps(model, mb, temperature=self.args.sampling.temperature,
                                   chunked=self.args.use_chunked_logprobs)
            loss, metrics = ppo_loss(out["logps"], mb["old_logps"], mb["advantages"], out["values"],
                                     mb["old_values"], mb["returns"], mb["completion_mask"],
                                     cliprange=self.args.cliprange, cliprange_value=self.args.cliprange_value,
                                     vf_coef=self.args.vf_coef, num_tokens=num_tokens,
                                     importance_weights=mb.get("tis_weights"))
        for key, value in metrics.items():
            self._record(key, value)
        return loss

    # ---- rollout

    @torch.no_grad()
    def rollout(self, model, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Samples, scores, old log-probs/values, reference log-probs, rewards, advantages and returns: (B, C)."""
        prompt_ids, completion_ids, scores, logprobs = self.sample(model, rows) if self.online else (
            *offline_samples(self.processing_class, rows, self.args.sampling.max_new_tokens), None)
        batch = pad_rollout(prompt_ids, completion_ids, pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                            device=self.args.device)
        mask = batch["completion_mask"]
        scored = torch.tensor([s is not None for s in scores], device=mask.device)
        mask *= scored[:, None]  # unscored completions (a reward function returned None) are left out
        raw = torch.tensor([s if s is not None else 0.0 for s in scores], device=mask.device)
        completions = batch["input_ids"][:, -mask.shape[1]:]
        eos = (torch.isin(completions, torch.tensor(self.eos_ids, device=mask.device)) & mask.bool()).any(-1)
        score = raw - (self.args.missing_eos_penalty or 0.0) * ~eos

        with self.compute_loss_context_manager():
            old = completion_logps(model, batch, temperature=self.args.sampling.temperature, with_entropy=True,
                                   chunked=self.args.use_chunked_logprobs)
            ref_logps = self.reference_logps(model, batch)
        rewards, kl = per_token_rewards(old["logps"], ref_logps, score, mask, kl_coef=self.args.kl_coef,
                                        kl_estimator=self.args.kl_estimator)
        # whitened over the whole rollout batch, every process's shard (not per shard)
        if self.args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, reduce=self.sum_over_processes)
        advantages, returns = gae(rewards, old["values"], mask, gamma=self.args.gamma, lam=self.args.lam)
        advantages = masked_whiten(advantages, mask, reduce=self.sum_over_processes)
        self._log_rollout(raw, scored, eos, kl, old, returns, mask)
        out = {**batch, "old_logps": old["logps"], "old_values": old["values"], "advantages": advantages,
               "returns": returns}
        if logprobs is not None:  # the sampler's own log-probs: correct for samples the policy did not draw
            weights = self.importance_weights(old["logps"], logprobs, mask)
            if weights is not None:
                out["tis_weights"] = weights
        return out

    def importance_weights(self, old_logps: torch.Tensor, logprobs: list[list[float]],
                           mask: torch.Tensor) -> torch.Tensor | None:
        """min(π/μ, tis_cap) per token, π the policy at sampling time (old_logps), μ the sampler; the mean
        ratio and capped share are logged over every rank's tokens (`tis/*`); None with tis_cap null."""
        a = self.args
        mu = sampler_logps(logprobs, mask.shape[1]).to(old_logps.device)
        cap = a.vllm_importance_sampling_cap if a.vllm_importance_sampling_cap is not None else math.inf
        weights, metrics = truncated_importance_weights(old_logps, mu, mask, cap=cap)
        tokens = mask.sum().item()
        for key, value in metrics.items():
            self._record_mean(key, value.item() * tokens, tokens)
        return weights if a.vllm_importance_sampling_cap is not None else None

    def sample(self, model, rows: list[dict]) -> tuple[list, list, list[float | None]]:
        """One completion per prompt from the current policy, scored by the reward functions."""
        prompts = [r["prompt"] for r in rows]
        a = self.args
        # vllm: off-policy once training moves the policy; gens.logprobs (the sampler's) let the rollout correct it
        gens = sample_online(unwrap(model).pretrained_model, self.processing_class, prompts, a.sampling,
                             seed=stable_seed(a.seed, self.state.global_step))
        totals, per_function = self.reward_fn(prompts, gens.completions, **gens.reward_columns(rows))
        # every rank gathers every key, also with nothing scored here (a skipped gather would pair with the next)
        for name, values in per_function.items():
            got = [v for v in values if v is not None]
            self._record_mean(f"rewards/{name}", float(sum(got)), len(got))
        scored = self.accelerator.gather(torch.tensor([sum(t is not None for t in totals)], device=a.device)).sum()
        if scored == 0:  # on every rank at once; one rank's unscored batch trains with an empty mask instead
            raise ValueError("every completion of this batch was left unscored (the reward functions returned None "
                             "for all of them); check that the rows carry the columns the functions need")
        return [gens.prompt_ids[i] for i in gens.prompt_index], gens.completion_ids, totals, gens.logprobs

    def reference_logps(self, model, batch) -> torch.Tensor:
        """Per-token log-probs of the reference LM (no value head): (B, C)."""
        with reference_model(unwrap(model).pretrained_model, self.ref_model,
                             precision=trainer_precision(self.args)) as ref:
            return completion_logps(ref, batch, temperature=self.args.sampling.temperature,
                                    chunked=self.args.use_chunked_logprobs)["logps"]

    # ---- metrics, saving

    def _log_rollout(self, score, scored, eos, kl, old, returns, mask) -> None:
        """score: (B,) before the missing-EOS penalty; kl: (B, T) the configured estimator. Means over every
        rank's scored rows (tokens), so a rank with none adds nothing rather than a 0."""
        rows = scored.float().sum().item()
        self._record_mean("score", (score * scored).sum().item(), rows)
        self._record_mean("kl", kl.sum().item(), rows)
        self._record_mean("entropy", (old["entropy"] * mask).sum().item(), mask.sum().item())
        self._record("completion_length", mask.sum(-1).float().mean())
        self._record("eos_rate", eos.float().mean())
        ev = explained_variance(old["values"], returns, mask)  # NaN with < 2 valid tokens on this rank
        finite = bool(torch.isfinite(ev))
        self._record_mean("explained_variance", ev.item() if finite else 0.0, int(finite))

    def _record_mean(self, key: str, total: float, count: int) -> None:
        """The mean over every rank's `count` items (`total` their sum here); nothing when no rank has any."""
        total, count = self.accelerator.gather(torch.tensor([[total, count]], device=self.args.device)).sum(0)
        if count > 0:
            self._metrics[key].append((total / count).item())

    def _record(self, key: str, value: torch.Tensor) -> None:
        self._metrics[key].append(self.accelerator.gather_for_metrics(value.detach().reshape(1)).float().mean().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for key, values in self._metrics.items():
            logs[key] = sum(values) / len(values)
        self._metrics.clear()
        self.warn_off_policy(logs)
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The LM as save_pretrained writes it, value_head.safetensors, the tokenizer and the arguments."""
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        wrapper = self.accelerator.unwrap_model(self.model) if model is None else model
        super()._load_from_checkpoint(resume_from_checkpoint, model=wrapper.pretrained_model)
        wrapper.load_extra_weights(resume_from_checkpoint)
