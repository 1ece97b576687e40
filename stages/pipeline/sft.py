"""Stage `sft`: supervised fine-tuning of the base model on the preprocessed SFT rows.

Full fine-tuning with the loss on completion tokens only (`stages.trainers.sft`). Writes
`model/` (an ordinary Hugging Face model directory with its tokenizer) and `log_history.json`.

    python -m stages sft [--set sft.learning_rate=1e-3]
    accelerate launch -m stages sft        # several GPUs (see README)
"""
from __future__ import annotations

import json
import sys
from typing import Any

from stages.data import DataError, read_jsonl
from stages.models import load_causal_lm, load_tokenizer, model_fingerprint, pick_device, resolve_model
from transformers import PrinterCallback

from stages.trainers.callbacks import LogToLogger
from stages.trainers.sft import SFTConfig, SFTTrainer


def run(ctx) -> dict[str, Any]:
    p, s = ctx.params, ctx.params.sft
    device = pick_device(p.run.device)
    base = resolve_model(p.model, p.run.output_dir)
    tokenizer = load_tokenizer(base, trust_remote_code=p.model.trust_remote_code)
    model = load_causal_lm(base, dtype=p.model.dtype, device=device, trust_remote_code=p.model.trust_remote_code)
    data = ctx.inputs["preprocess"]
    train = read_jsonl(data / "sft_train.jsonl") if (data / "sft_train.jsonl").exists() else []
    if not train:
        raise DataError(f"{data}/sft_train.jsonl: no SFT rows; data.source must hold SFT data "
                        "(messages, prompt/completion, instruction/output or text)")
    val_path = data / "sft_validation.jsonl"
    val = read_jsonl(val_path) if val_path.exists() else []

    args = SFTConfig(
        output_dir=str(ctx.out.parent / ".work" / "sft"),
        learning_rate=s.learning_rate, num_train_epochs=s.num_train_epochs, max_steps=s.max_steps,
        per_device_train_batch_size=s.per_device_train_batch_size, per_device_eval_batch_size=256,
        gradient_accumulation_steps=s.gradient_accumulation_steps, warmup_steps=s.warmup_ratio,
        weight_decay=s.weight_decay, lr_scheduler_type=s.lr_scheduler_type, logging_steps=s.logging_steps,
        max_seq_length=s.max_seq_length, completion_only_loss=s.completion_only_loss,
        eval_strategy="epoch" if val else "no", save_strategy="no", report_to=s.report_to or "none",
        seed=p.run.seed, data_seed=p.run.seed, use_cpu=device == "cpu",
        disable_tqdm=not sys.stderr.isatty(), dataloader_num_workers=0,
        bf16=p.model.dtype == "bfloat16" and device == "cuda", fp16=False,
    )
    logger = LogToLogger(ctx.log)
    trainer = SFTTrainer(model, args, processing_class=tokenizer, train_dataset=train,
                         eval_dataset=val or None, callbacks=[logger])
    trainer.remove_callback(PrinterCallback)  # LogToLogger already reports every log line
    ctx.log.info("sft: %d train rows, %d validation rows, %d parameters, device %s", len(train), len(val),
                 sum(x.numel() for x in model.parameters()), device)
    result = trainer.train()
    final_eval = trainer.evaluate() if val else {}
    if trainer.is_world_process_zero():
        trainer.save_model(str(ctx.out / "model"))
        tokenizer.save_pretrained(str(ctx.out / "model"))
        (ctx.out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
    losses = [h["loss"] for h in logger.history if "loss" in h]
    return {
        "train_loss": round(result.training_loss, 5),
        "first_logged_loss": losses[0] if losses else None,
        "last_logged_loss": losses[-1] if losses else None,
        "eval_loss": final_eval.get("eval_loss"),
        "eval_mean_token_accuracy": final_eval.get("eval_mean_token_accuracy"),
        "steps": trainer.state.global_step,
        "train_rows": len(train),
        "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 2),
        "base_model": {"name_or_path": p.model.name_or_path, "fingerprint": model_fingerprint(p.model, p.run.output_dir)},
    }
