"""Stage `policy`: preference optimisation of the SFT model (`policy.method: dpo`).

DPO on the preference pairs of `preprocess` (`preference.jsonl`: prompt/chosen/rejected),
starting from the SFT model, which is also the frozen reference (or, with `policy.lora`,
the same weights with the adapter disabled). Checkpoints and crash-resume as in `sft`.
Writes `model/`, `tensorboard/` and `log_history.json`.

    python -m stages policy [--set policy.beta=0.2] [--set policy.loss_type=ipo]
"""
from __future__ import annotations

from typing import Any

from stages.data import DataError, read_jsonl
from stages.models import load_tokenizer, pick_device
from stages.pipeline import training
from stages.trainers.dpo import DPOConfig, DPOTrainer


def run(ctx) -> dict[str, Any]:
    p, s = ctx.params, ctx.params.policy
    if s.method == "none":
        ctx.log.info("policy: method none, no preference optimisation; evaluate reports base and SFT only")
        return {"method": "none"}
    device = pick_device(p.run.device)
    start = str(ctx.inputs["sft"] / "model")
    pairs_path = ctx.inputs["preprocess"] / "preference.jsonl"
    pairs = read_jsonl(pairs_path) if pairs_path.exists() else []
    if not pairs:
        raise DataError(f"{pairs_path}: no preference pairs; policy.method = dpo needs prompt/chosen/rejected rows "
                        "(data.source in preference format, or builtin:arithmetic)")
    tokenizer = load_tokenizer(start, trust_remote_code=p.model.trust_remote_code)
    model, trainable, total = training.load_trainable_model(start, p, s, device=device)
    args = DPOConfig(**training.trainer_args(ctx, s, device=device, section="policy"), beta=s.beta,
                     loss_type=s.loss_type, label_smoothing=s.label_smoothing, reference_free=s.reference_free,
                     max_length=s.max_length)
    logger, callbacks = training.callbacks(ctx, s.report_to)
    trainer = DPOTrainer(model, args=args, processing_class=tokenizer, train_dataset=pairs, callbacks=callbacks)
    ctx.log.info("policy: dpo on %d pairs from %s, beta %.3g, %s loss, %d/%d trainable parameters", len(pairs), start,
                 s.beta, s.loss_type, trainable, total)
    result, resume = training.train(trainer, ctx)
    training.save_outputs(trainer, tokenizer, ctx)
    last = next((h for h in reversed(logger.history) if "rewards/accuracies" in h), {})
    return {
        "method": s.method,
        "train_loss": round(result.training_loss, 5),
        "steps": trainer.state.global_step,
        "pairs": len(pairs),
        "resumed_from": resume,
        "last_reward_accuracy": last.get("rewards/accuracies"),
        "last_reward_margin": last.get("rewards/margins"),
        "trainable_parameters": trainable,
        "adapter": s.lora.enabled,
        "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 2),
    }
