"""Stage `sft`: supervised fine-tuning of the base model on the preprocessed SFT rows.

Full fine-tuning or LoRA/QLoRA (`sft.lora`), the loss on completion (or assistant) tokens
only, optional packing, gradient checkpointing and streaming (`stages.trainers.sft_trainer`).
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
from typing import Any

from stages.data import DataError, read_jsonl
from stages.harness.model_paths import model_fingerprint, resolve_model
from stages.models import load_tokenizer, pick_device
from stages.pipeline import training
from stages.trainers.sft_trainer import SFTTrainer


def run(ctx) -> dict[str, Any]:
    p, s = ctx.params, ctx.params.sft
    device = pick_device(p.run.device)
    base = resolve_model(p.model, p.run.output_dir)
    tokenizer = load_tokenizer(base, trust_remote_code=p.model.trust_remote_code)
    train, val = load_rows(ctx, s)
    args = training.trainer_config(ctx, s, device=device, section="sft",
                                   eval_strategy="epoch" if val and not s.streaming else "no", eval_steps=None)
    model, trainable, total = training.load_trainable_model(base, p, s, device=device, section="sft")
    logger, callbacks = training.callbacks(ctx, s.report_to)
    trainer = SFTTrainer(model, args, processing_class=tokenizer, train_dataset=train, eval_dataset=val or None,
                         formatting_func=load_formatting_func(s.formatting_func), callbacks=callbacks)
    if s.eval_steps:
        trainer.add_callback(online_eval(trainer, val, s))
    ctx.log.info("sft: %s train rows, %d validation rows, %d/%d trainable parameters (%.2f%%), device %s",
                 "streamed" if s.streaming else len(train), len(val), trainable, total, 100 * trainable / total,
                 device)
    result, resume = training.train(trainer, ctx)
    final_eval = trainer.evaluate() if val and not s.streaming else {}
    training.save_outputs(trainer, tokenizer, ctx)
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
        "precision": training.precision_report(trainer),
        "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 2),
        "base_model": {"name_or_path": p.model.name_or_path,
                       "fingerprint": model_fingerprint(p.model, p.run.output_dir)},
    }


def online_eval(trainer, val: list[dict], s):
    """Greedy exact match on the first sft.eval_samples validation prompts every sft.eval_steps steps."""
    from stages.reward_functions import exact_match
    from stages.trainers.callbacks import OnlineEval

    rows = [r for r in val if "prompt" in r][: s.eval_samples]
    if not rows:
        raise ValueError(f"sft.eval_steps = {s.eval_steps} needs validation rows with a prompt (prompt/completion "
                         "data and preprocess.validation_fraction > 0); set sft.eval_steps: 0 to turn it off")
    return OnlineEval(trainer, rows, every=s.eval_steps, score_fn=exact_match, batch_size=s.eval_samples)


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


def training_rows(params, manifests: dict[str, dict]) -> dict[str, Any] | None:
    """The rows an epoch trains on and one device's share of a step (`StageSpec.training_rows`, for the
    checks of `stages.harness.launch`); None before preprocess has counted them."""
    n = manifests["preprocess"].get("metrics", {}).get("rows", {}).get("sft_train")
    return None if not isinstance(n, int) else {
        "rows": n, "what": "SFT rows", "per_device": params.sft.per_device_train_batch_size, "unit": "rows",
        "batch_key": "sft.per_device_train_batch_size"}
