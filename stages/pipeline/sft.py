"""Stage `sft`: supervised fine-tuning of the base model on the preprocessed SFT rows.

Full fine-tuning or LoRA/QLoRA (`sft.lora`), the loss on completion (or assistant) tokens
only, optional packing, gradient checkpointing and streaming (`stages.trainers.sft`).
Checkpoints go to the stage's work folder every `sft.save_steps`; a rerun after a crash
resumes from the last one (weights, optimizer, scheduler, RNG, data position).

Writes `model/` (a full Hugging Face model, or a PEFT adapter that
`peft.PeftModel.from_pretrained` loads, with the tokenizer and chat template either way),
`tensorboard/` and `log_history.json`.

    python -m stages sft [--set sft.learning_rate=1e-3] [--set sft.lora.enabled=true]

One process on one device for now; multi-GPU launching (Accelerate) is a later step.
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from typing import Any

from transformers import PrinterCallback
from transformers.trainer_utils import get_last_checkpoint

from stages.data import DataError, read_jsonl
from stages.models import load_causal_lm, load_tokenizer, model_fingerprint, pick_device, resolve_model
from stages.trainers.adapters import apply_lora, quantization_config, trainable_fraction
from stages.trainers.callbacks import LogToLogger, tensorboard_callback
from stages.trainers.sft import SFTConfig, SFTTrainer


def run(ctx) -> dict[str, Any]:
    p, s = ctx.params, ctx.params.sft
    device = pick_device(p.run.device)
    base = resolve_model(p.model, p.run.output_dir)
    tokenizer = load_tokenizer(base, trust_remote_code=p.model.trust_remote_code)
    train, val = load_rows(ctx, s)
    model = load_causal_lm(base, dtype=p.model.dtype, device=device, trust_remote_code=p.model.trust_remote_code,
                           quantization_config=quantization_config(s.lora, device=device))
    if s.gradient_checkpointing:
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=s.gradient_checkpointing_every)
    if s.lora.enabled:
        model = apply_lora(model, s.lora)
    trainable, total = trainable_fraction(model)

    precision = mixed_precision(s.mixed_precision, device)
    check_trackers(s.report_to)
    args = SFTConfig(
        output_dir=str(ctx.work / "checkpoints"),
        learning_rate=s.learning_rate, num_train_epochs=s.num_train_epochs, max_steps=s.max_steps,
        per_device_train_batch_size=s.per_device_train_batch_size, per_device_eval_batch_size=64,
        gradient_accumulation_steps=s.gradient_accumulation_steps, warmup_steps=s.warmup_ratio,
        weight_decay=s.weight_decay, lr_scheduler_type=s.lr_scheduler_type, logging_steps=s.logging_steps,
        max_seq_length=s.max_seq_length, completion_only_loss=s.completion_only_loss,
        assistant_only_loss=s.assistant_only_loss, dataset_text_field=s.dataset_text_field,
        packing=s.packing, packing_strategy=s.packing_strategy,
        eval_strategy="epoch" if val and not s.streaming else "no",
        save_strategy="steps", save_steps=s.save_steps, save_total_limit=2,
        report_to=[r for r in s.report_to if r != "tensorboard"] or "none",
        seed=p.run.seed, data_seed=p.run.seed, use_cpu=device == "cpu", dataloader_num_workers=0,
        disable_tqdm=not sys.stderr.isatty(), bf16=precision == "bf16", fp16=precision == "fp16",
    )
    logger = LogToLogger(ctx.log)
    callbacks = [logger] + ([tensorboard_callback(ctx.work / "tensorboard")] if "tensorboard" in s.report_to else [])
    trainer = SFTTrainer(model, args, processing_class=tokenizer, train_dataset=train, eval_dataset=val or None,
                         formatting_func=load_formatting_func(s.formatting_func), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # LogToLogger already reports every log line
    resume = get_last_checkpoint(args.output_dir) if (ctx.work / "checkpoints").is_dir() else None
    ctx.log.info("sft: %s train rows, %d validation rows, %d/%d trainable parameters (%.2f%%), device %s%s",
                 "streamed" if s.streaming else len(train), len(val), trainable, total, 100 * trainable / total,
                 device, f", resuming from {resume}" if resume else "")
    result = trainer.train(resume_from_checkpoint=resume)
    final_eval = trainer.evaluate() if val and not s.streaming else {}
    if trainer.is_world_process_zero():
        trainer.save_model(str(ctx.out / "model"))
        tokenizer.save_pretrained(str(ctx.out / "model"))
        (ctx.out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
        if (ctx.work / "tensorboard").is_dir():
            shutil.copytree(ctx.work / "tensorboard", ctx.out / "tensorboard")
    losses = [h["loss"] for h in logger.history if "loss" in h]
    return {
        "train_loss": round(result.training_loss, 5),
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "eval_loss": final_eval.get("eval_loss"),
        "eval_mean_token_accuracy": final_eval.get("eval_mean_token_accuracy"),
        "steps": trainer.state.global_step,
        "resumed_from": resume,
        "train_rows": None if s.streaming else len(train),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "adapter": s.lora.enabled,
        "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 2),
        "base_model": {"name_or_path": p.model.name_or_path, "fingerprint": model_fingerprint(p.model, p.run.output_dir)},
    }


def load_rows(ctx, s):
    """(train rows or a streamed IterableDataset, validation rows)."""
    data = ctx.inputs["preprocess"]
    train_path, val_path = data / "sft_train.jsonl", data / "sft_validation.jsonl"
    if not train_path.exists() or train_path.stat().st_size == 0:
        raise DataError(f"{train_path}: no SFT rows; data.source must hold SFT data "
                        "(messages, prompt/completion, instruction/output or text)")
    val = read_jsonl(val_path) if val_path.exists() else []
    if s.streaming:
        import datasets

        return datasets.load_dataset("json", data_files=str(train_path), split="train", streaming=True), val
    return read_jsonl(train_path), val


def load_formatting_func(path: str | None):
    if path is None:
        return None
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"sft.formatting_func = {path!r}: cannot import it ({e})") from None


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_trackers(report_to: list[str]) -> None:
    import importlib.util

    for name in report_to:
        if name not in TRACKERS:
            raise ValueError(f"sft.report_to: unknown tracker {name!r}; supported: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"sft.report_to includes {name!r} but the {TRACKERS[name]} package is not installed: "
                             f"pip install {TRACKERS[name]}, or remove it from sft.report_to")


def mixed_precision(setting: str, device: str) -> str:
    import torch

    if setting == "auto":
        return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "no"
    if setting != "no" and device != "cuda":
        raise ValueError(f"sft.mixed_precision = {setting!r} needs a GPU; this run is on {device} (use auto or no)")
    return setting
