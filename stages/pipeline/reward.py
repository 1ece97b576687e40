"""Stage `reward`: a reward model trained on preference pairs, with a quality gate.

A one-output sequence classifier initialised from the SFT model (its trunk; a fresh
scalar head) learns `r(prompt, completion)` with the Bradley-Terry loss
(`stages.losses.reward_loss`) on preprocess's preference pairs, minus a held-out share
(`reward.eval_fraction`) on which it reports pair accuracy and a reliability table (the
model's confidence in the side it prefers, σ(|r_c − r_r|), binned, against how often that
side is the chosen one) with its expected calibration error. When the one-sided Wilson lower
bound of that accuracy at `reward.gate_confidence` is below `reward.min_accuracy`
(`stages.gates.reward_gate`: a pass means "at least that accurate, with that confidence", so
a handful of held-out pairs cannot pass) the stage fails and nothing downstream runs: a reward
model no better than that must not steer sampling or RL. Writes `model/` (loadable with
`AutoModelForSequenceClassification`), `calibration.json`, `log_history.json`, `tensorboard/`.

    python -m stages reward [--set reward.learning_rate=3e-4] [--set reward.min_accuracy=0]
"""
from __future__ import annotations

import functools
import json
import random
from typing import Any

from stages import gates
from stages.data import read_jsonl
from stages.harness.errors import QualityGateFailed
from stages.models import load_tokenizer, pick_device
from stages.pipeline import training
from stages.reward_model import evaluate_reward_model, load_reward_model
from stages.trainers.reward_trainer import RewardTrainer


def run(ctx) -> dict[str, Any]:
    p, r = ctx.params, ctx.params.reward
    pairs_path = ctx.inputs["preprocess"] / "preference.jsonl"
    pairs = read_jsonl(pairs_path) if pairs_path.exists() else []
    if not pairs:
        ctx.log.info("reward: %s has no preference pairs; no reward model trained (reward functions named "
                     "reward_model will fail; use rule rewards)", pairs_path)
        return {"trained": False, "reason": f"no preference pairs in {pairs_path.name}"}
    train_pairs, held_out = split_pairs(pairs, r.eval_fraction, p.run.seed)
    device = pick_device(p.run.device)
    start = str(ctx.inputs["sft"] / "model")
    tokenizer = load_tokenizer(start, trust_remote_code=p.model.trust_remote_code)
    args = training.trainer_config(ctx, r, device=device, section="reward")
    model, trainable, total = training.load_trainable_model(
        start, p, r, device=device, section="reward", load=functools.partial(load_reward_model, tokenizer=tokenizer),
        task_type="SEQ_CLS")
    logger, callbacks = training.callbacks(ctx, r.report_to)
    trainer = RewardTrainer(model, args=args, processing_class=tokenizer, train_dataset=train_pairs,
                            callbacks=callbacks)
    ctx.log.info("reward: %d training pairs, %d held out, from %s; %d/%d trainable parameters", len(train_pairs),
                 len(held_out), start, trainable, total)
    result, resume = training.train(trainer, ctx)
    quality = evaluate_reward_model(trainer.model, tokenizer, held_out, batch_size=args.per_device_eval_batch_size,
                                    max_length=r.max_length, bins=r.calibration_bins)
    passed, verdict = gates.reward_gate(quality["accuracy"], len(held_out), min_accuracy=r.min_accuracy,
                                        confidence=r.gate_confidence)
    ctx.log.info("reward: %s; ECE %.3f", verdict, quality["ece"])
    trainer.log({f"eval_{k}": quality[k] for k in ("accuracy", "mean_margin", "ece")})  # trackers, log, model card
    if not passed:
        raise QualityGateFailed(
            f"reward: {verdict} Nothing downstream runs. Train longer or with another learning rate "
            "(reward.num_train_epochs, reward.learning_rate), add pairs, or lower the gate (reward.min_accuracy, "
            "reward.gate_confidence) if you accept a weaker reward model")
    training.save_outputs(trainer, tokenizer, ctx)
    (ctx.out / "calibration.json").write_text(json.dumps(quality, indent=2))
    return {
        "trained": True,
        "accuracy": round(quality["accuracy"], 4),
        "mean_margin": round(quality["mean_margin"], 4),
        "ece": round(quality["ece"], 4),
        "train_pairs": len(train_pairs),
        "held_out_pairs": len(held_out),
        "train_loss": round(result.training_loss, 5),
        "steps": trainer.state.global_step,
        "resumed_from": resume,
        "trainable_parameters": trainable,
        "adapter": r.lora.enabled,
        "precision": training.precision_report(trainer),
        "table": quality["calibration"],
    }


def split_pairs(pairs: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic held-out split; at least one pair on each side."""
    if len(pairs) < 2:
        raise ValueError(f"reward: {len(pairs)} preference pair(s); need at least 2 (one to train, one to check)")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(len(pairs) * fraction)), len(pairs) - 1)
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


def training_rows(params, manifests: dict[str, dict]) -> dict[str, Any] | None:
    """The training pairs (the held-out share excluded) and one device's share of a step
    (`StageSpec.training_rows`, for the checks of `stages.harness.launch`); None before preprocess has counted them."""
    n = manifests["preprocess"].get("metrics", {}).get("rows", {}).get("preference")
    return None if not isinstance(n, int) else {
        "rows": n - round(n * params.reward.eval_fraction), "what": "preference pairs",
        "per_device": params.reward.per_device_train_batch_size, "unit": "rows",
        "batch_key": "reward.per_device_train_batch_size"}
