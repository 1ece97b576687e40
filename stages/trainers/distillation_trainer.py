"""On-policy distillation: `DistillationTrainer` (a `transformers.Trainer`; config: `distillation_config.py`).

Every micro-batch the student samples one completion per prompt (`stages.generation`, seeded from
the run seed, the step and the prompt); the student and the frozen teacher then both run over
prompt + completion, and at every completion position the student's next-token distribution is
pulled towards the teacher's by `stages.losses.distillation_loss` (beta = 1: the reverse KL, so
the student learns where its own samples go wrong). The teacher must share the student's
vocabulary and tokenizer: it scores the student's token ids as they are. Evaluation does the same on the
`eval_dataset` prompts (a fixed draw, no update): `eval_loss` is the divergence there, as TRL's.
"""
from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer

from stages.basics import stable_seed
from stages.logprobs import final_hidden, lm_head_for_chunking, no_logits
from stages.losses import distillation_loss
from stages.precision import autocast_forward, trainer_precision, use_fp32_cpu_attention
from stages.sharding import unwrap
from stages.tools.episodes import transcript
from stages.trainers.distillation_config import DistillationConfig
from stages.trainers.eval_predictions import EVAL_DRAW
from stages.trainers.grpo_trainer import completion_tensors, rows_collator
from stages.trainers.inputs import (
    apply_peft,
    check_dataset,
    default_args,
    disable_dropout,
    load_model,
    load_processing_class,
    map_eval,
    rows_with_prompts,
)
from stages.trainers.online_extras import (
    PromptBatchSampler,
    completion_sample,
    log_completion_sample,
    pad_to_multiple,
    render_prompts,
)
from stages.trainers.online_generation import sample_online, wait_for_server
from stages.trainers.rollout import position_ids
from stages.trainers.tool_rollout import Agent, Rollout, from_generations, token_prompts, tool_metrics


def completion_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's next-token logits at the completion positions where completion_mask is 1: (N, V).

    Position t's logits come from the hidden state at column P + t - 1 (P: the prompt width). Only those N
    rows go through the output layer where the model allows it (`stages.logprobs.lm_head_for_chunking`);
    otherwise the full logits are computed and indexed.
    """
    mask = batch["completion_mask"]
    width = mask.shape[1]
    start = batch["input_ids"].shape[1] - width - 1
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": position_ids(batch["attention_mask"]), "use_cache": False}
    select = mask.bool()
    head = lm_head_for_chunking(model)
    if head is not None:
        hidden, _ = final_hidden(model, inputs, logits_to_keep=no_logits(model))
        return head(hidden[:, start:start + width][select].to(head.weight.dtype))
    return model(**inputs).logits[:, start:start + width][select]


def load_teacher(teacher, args: DistillationConfig) -> nn.Module:
    """The teacher module: given, or loaded from its folder or id with teacher_model_init_kwargs and revision."""
    if isinstance(teacher, nn.Module):
        return teacher
    kwargs = dict(args.teacher_model_init_kwargs or {})
    if args.teacher_model_revision is not None:
        kwargs.setdefault("revision", args.teacher_model_revision)
    return load_model(teacher, SimpleNamespace(model_init_kwargs=kwargs, trust_remote_code=args.trust_remote_code))


def check_teacher(student: nn.Module, teacher: nn.Module, tokenizer, teacher_source, key: str) -> None:
    """The teacher must read the student's token ids: the same output vocabulary and, when it comes with a folder,
    the same tokenizer vocabulary. `key` names where the teacher came from in the error."""
    sizes = [unwrap(m).get_output_embeddings().weight.shape[0] for m in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"{key} = {teacher_source!r}: the teacher's output vocabulary has {sizes[1]} tokens, the "
                         f"student's {sizes[0]}; distillation compares their next-token distributions token by "
                         "token, so the teacher must share the student's tokenizer (e.g. a larger model of the same "
                         "family, or an earlier run of the same base)")
    if isinstance(teacher_source, (str, os.PathLike)) and os.path.isdir(teacher_source):
        from stages.models import load_tokenizer

        theirs = load_tokenizer(str(teacher_source))
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"{key} = {str(teacher_source)!r}: the teacher's tokenizer differs from the student's "
                             "(a different vocabulary): the teacher would score other tokens than the student "
                             "sampled; use a teacher trained with the student's tokenizer")


class DistillationTrainer(Trainer):
    args: DistillationConfig  # the config this trainer is built with (TrainingArguments to transformers)
    processing_class: Any  # a tokenizer (transformers types it as any processor)
    train_dataset: Any  # the prompt rows, a list
    loss_is_scaled_for_ga = True  # a sum over the micro-batch's positions / the whole step's (see compute_loss)

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, *, data_collator=None):
        args = args or default_args(DistillationConfig, model, "Distillation")
        rows = rows_with_prompts(train_dataset, "train_dataset", method="distillation")
        eval_dataset = map_eval(check_dataset(eval_dataset, "eval_dataset", allow_dict=True), lambda data, name: (
            None if data is None else rows_with_prompts(data, name, method="distillation")), named=True)
        key = "teacher_model" if teacher_model is not None else "DistillationConfig.teacher_model_name_or_path"
        source = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if source is None:
            raise ValueError("DistillationTrainer: no teacher; pass teacher_model= (a folder, an id or a model) or "
                             "set DistillationConfig.teacher_model_name_or_path")
        processing_class = load_processing_class(model, processing_class, args)
        self.agent = Agent(processing_class, tools=tools, environment_factory=None, args=args,
                           model_name=str(getattr(model, "name_or_path", model))) if tools else None
        if self.agent is not None:
            self.agent.check_rows(rows, "train_dataset")
        model = apply_peft(load_model(model, args, quantization_config), peft_config)
        teacher = load_teacher(source, args)
        check_teacher(model, teacher, processing_class, source, key)
        if args.disable_dropout:
            disable_dropout(model)
        if args.use_vllm:
            wait_for_server(args.sampling.vllm_url, timeout=args.vllm_server_timeout)
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        use_fp32_cpu_attention(teacher)
        collate: Any = data_collator or rows_collator  # prompt rows pass through; sampled in training_step
        super().__init__(model=model, args=args, data_collator=collate,
                         processing_class=processing_class, train_dataset=rows, eval_dataset=eval_dataset,
                         callbacks=callbacks, optimizers=optimizers)
        self.teacher_model = teacher.eval().requires_grad_(False)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def get_train_dataloader(self) -> DataLoader:
        a = self.args
        sampler = PromptBatchSampler(len(self.train_dataset), a.per_device_train_batch_size, group=1, repeats=1,
                                     seed=a.seed, shuffle=a.shuffle_dataset)
        return self.accelerator.prepare(DataLoader(self.train_dataset, batch_sampler=sampler,
                                                   collate_fn=self.data_collator))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The optimizer step's micro-batches of prompts -> rollout batches (the student samples them all with the
        same weights), and their completion positions summed over micro-batches and processes: the loss's
        denominator, so the accumulated loss is the step's mean over positions, as TRL's."""
        rows, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = [self.make_batch(r) for r in rows]
        if not batches:
            return batches, None
        local = sum((b["completion_mask"].sum() for b in batches), torch.zeros((), device=self.args.device)).float()
        return batches, self.accelerator.reduce(local, reduction="sum").clamp(min=1)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(inputs, list):  # prompt rows (called outside the Trainer loop): this micro-batch alone
            inputs = self.make_batch(inputs)
        if num_items_in_batch is None:
            num_items_in_batch = inputs["completion_mask"].sum().float().clamp(min=1) * self.accelerator.num_processes
        return super().training_step(model, inputs, num_items_in_batch)

    @torch.no_grad()
    def make_batch(self, rows: list[dict], *, evaluation: bool = False) -> dict[str, torch.Tensor]:
        """One completion per prompt from the student: a rollout batch (`stages.trainers.rollout.pad_rollout`).
        The draw is the step's, or with `evaluation` the fixed EVAL_DRAW; the lengths go to that mode's metrics."""
        from stages.generation.common import eos_token_ids

        a, tok = self.args, self.processing_class
        student = self.accelerator.unwrap_model(self.model)
        r = self.sample(student, rows, evaluation=evaluation)
        metrics = self._metrics["eval" if evaluation else "train"]
        eos = eos_token_ids(tok, student)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        batch = completion_tensors(r.prompt_ids, r.completion_ids, eos_token_id=eos, pad_token_id=pad_id,
                                   tool_mask=r.tool_mask)
        if "tool_mask" in batch:  # tool outputs are context the student reads, not positions it is taught
            batch["completion_mask"] = batch["completion_mask"] * batch.pop("tool_mask")
        batch = pad_to_multiple(batch, a.pad_to_multiple_of, pad_id)
        lengths = batch["completion_mask"].sum(1).float()
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/truncated_ratio"].append(batch.pop("truncated").float().mean().item())
        if a.log_completions and not evaluation and self.state.global_step % max(int(a.logging_steps), 1) == 0:
            texts = [transcript(c) if isinstance(c, list) else c for c in r.completions]
            rows_out = completion_sample(r.prompts, texts, [None] * len(texts), limit=a.num_completions_to_print,
                                         unique_prompts=a.log_unique_prompts)
            log_completion_sample(rows_out, self.state.global_step)
        return {k: v.to(a.device) for k, v in batch.items()}

    def sample(self, student, rows: list[dict], *, evaluation: bool = False) -> Rollout:
        """One completion per prompt from the student: one sampled turn, or an episode with the tools. The draw is
        the step's, or with `evaluation` the fixed EVAL_DRAW."""
        a, tok = self.args, self.processing_class
        draw = EVAL_DRAW if evaluation else self.state.global_step
        if self.agent is not None:
            def generate(contexts, n, round_):
                gens = sample_online(student, tok, token_prompts(tok, contexts), dataclasses.replace(a.sampling, n=n),
                                     seed=stable_seed(a.seed, draw, round_), precision=trainer_precision(a))
                return list(zip(gens.completion_ids, gens.logprobs or [None] * len(gens), strict=True))

            rollout = self.agent.run(rows, 1, generate)
            for key, value in tool_metrics(self.accelerator, self.agent.runner, len(rows)).items():
                self._metrics["eval" if evaluation else "train"][key].append(value)
            return rollout
        prompts = [r["prompt"] for r in rows]
        rendered = render_prompts(tok, prompts, a.chat_template_kwargs, [r.get("tools") for r in rows])
        gens = sample_online(student, tok, rendered, a.sampling, seed=stable_seed(a.seed, draw),
                             precision=trainer_precision(a))
        return from_generations(gens, rows, prompts)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        a = self.args
        student = completion_logits(model, inputs)
        teacher_model = self.teacher_model.to(self.args.device)
        with torch.no_grad(), autocast_forward(teacher_model, trainer_precision(a)) as teacher_model:
            teacher = completion_logits(teacher_model, inputs)
        loss, metrics = distillation_loss(student, teacher, beta=a.beta, temperature=a.sampling.temperature,
                                          num_items_in_batch=num_items_in_batch)
        loss = loss * self.accelerator.num_processes  # DDP averages the ranks' gradients; the step wants their sum
        mode = self._metrics["train" if model.training else "eval"]
        for key, value in metrics.items():
            mode[key].append(self.accelerator.gather_for_metrics(value.detach().float()).mean().item())
        return (loss, {"logits": student}) if return_outputs else loss

    @torch.no_grad()
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval on a batch of prompts: the student samples one completion each (`make_batch`'s evaluation draw);
        the loss is the divergence from the teacher, the mean over this batch's completion positions."""
        batch = self.make_batch(inputs, evaluation=True)
        positions = batch["completion_mask"].sum().float().clamp(min=1)
        with self.compute_loss_context_manager():  # compute_loss scales by the processes for DDP: undone here
            loss = self.compute_loss(model, batch, num_items_in_batch=positions * self.accelerator.num_processes)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if getattr(self.model, "training", True) else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._metrics[mode].items():
            logs[f"{prefix}{key}"] = sum(values) / len(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)


__all__ = ["DistillationConfig", "DistillationTrainer", "check_teacher", "completion_logits", "load_teacher"]
