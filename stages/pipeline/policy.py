"""Stage `policy`: optimise the SFT model with one method (`policy.method`).

    dpo         offline pairs (score's sampled-and-scored pairs, or preprocess's preference data),
                reference log-probs from stage `reference` when precomputed
    kto         unpaired desirable/undesirable rows (preprocess's unpaired data, or the pairs split)
    online_dpo  two completions per prompt sampled during training, ranked by the reward functions
    grpo        groups of completions per prompt, group-relative advantages from the reward functions
    ppo         rollouts scored by the reward model/functions, a value head, GAE and clipped updates
    none        skip (evaluate then reports base and SFT only)

Every method starts from the SFT model, which is also the frozen reference (or, with
`policy.lora`, the same weights with the adapter disabled). Checkpoints and crash-resume as
in `sft`. Writes `model/`, `tensorboard/` and `log_history.json`.

    python -m stages policy [--set policy.dpo.beta=0.2] [--set policy.method=grpo]
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from stages.models import load_tokenizer, pick_device
from stages.pipeline import training
from stages.pipeline.prompts import preference_pairs, prompt_rows, reward_model_path, unpaired_rows
from stages.reward_functions import build_reward_functions


def run(ctx) -> dict[str, Any]:
    p, pol = ctx.params, ctx.params.policy
    s, section = pol.trained, f"policy.{pol.method}"
    if pol.method == "none":
        ctx.log.info("policy: method none, no policy optimisation; evaluate reports base and SFT only")
        return {"method": "none"}
    device = pick_device(p.run.device)
    start = str(ctx.inputs["sft"] / "model")
    tokenizer = load_tokenizer(start, trust_remote_code=p.model.trust_remote_code)
    setup = METHODS[pol.method]
    rows, extra = setup.data(ctx)  # data, reward functions and the trainer config checked before any model loads
    config = training.trainer_config(ctx, s, device=device, section=section)
    model, trainable, total = training.load_trainable_model(start, p, s, device=device, section=section)
    logger, callbacks = training.callbacks(ctx, s.report_to)
    trainer = setup.trainer(ctx, model, tokenizer, config, rows, extra, callbacks)
    ctx.log.info("policy: %s on %d rows from %s, %d/%d trainable parameters", pol.method, len(rows), start,
                 trainable, total)
    result, resume = training.train(trainer, ctx)
    training.save_outputs(trainer, tokenizer, ctx)
    last = {}
    for h in logger.history:  # the last logged value of every metric
        last.update({k: v for k, v in h.items() if isinstance(v, (int, float))})
    return {
        "method": pol.method,
        "train_loss": round(result.training_loss, 5),
        "steps": trainer.state.global_step,
        "rows": len(rows),
        "resumed_from": resume,
        "trainable_parameters": trainable,
        "adapter": s.lora.enabled,
        "precision": training.precision_report(trainer),
        "train_runtime_s": round(result.metrics.get("train_runtime", 0.0), 2),
        "last": {k: round(v, 5) for k, v in last.items() if not k.startswith("train_") and k != "total_flos"},
    }


# --------------------------------------------------------------------------- data per method


def dpo_data(ctx):
    pol = ctx.params.policy
    if pol.dpo.precompute_ref_log_probs and not pol.dpo.reference_free:
        from stages.data import read_jsonl

        rows = read_jsonl(ctx.inputs["reference"] / "pairs.jsonl")  # pairs with the reference log-probs
        ctx.log.info("policy: reference log-probs of %d pairs from stage reference (no reference forward)",
                     len(rows))
        return rows, None
    return preference_pairs(ctx, pol.data)[1], None


def kto_data(ctx):
    return unpaired_rows(ctx, ctx.params.policy.data), None


def online_data(section: str):
    def data(ctx):
        p = ctx.params
        s = getattr(p.policy, section)
        rewards = build_reward_functions(s.reward_functions, key=f"policy.{section}.reward_functions",
                                         reward_model_path=reward_model_path(ctx), device=pick_device(p.run.device))
        return prompt_rows(ctx, p.policy.num_prompts), rewards.functions  # the trainer applies reward_weights
    return data


# --------------------------------------------------------------------------- trainer per method


def dpo_trainer(ctx, model, tokenizer, config, rows, _, callbacks):
    from stages.trainers.dpo_trainer import DPOTrainer

    return DPOTrainer(model, args=config, processing_class=tokenizer, train_dataset=rows, callbacks=callbacks)


def kto_trainer(ctx, model, tokenizer, config, rows, _, callbacks):
    from stages.trainers.kto_trainer import KTOTrainer

    return KTOTrainer(model, args=config, processing_class=tokenizer, train_dataset=rows, callbacks=callbacks)


def online_dpo_trainer(ctx, model, tokenizer, config, rows, rewards, callbacks):
    from stages.trainers.online_dpo_trainer import OnlineDPOTrainer

    return OnlineDPOTrainer(model, reward_funcs=rewards, args=config, processing_class=tokenizer, train_dataset=rows,
                            callbacks=callbacks)


def grpo_trainer(ctx, model, tokenizer, config, rows, rewards, callbacks):
    from stages.trainers.grpo_trainer import GRPOTrainer

    preference = None
    if config.reward_head == "shared":
        preference = preference_pairs(ctx, "preprocess", key="policy.grpo.reward_head")[1]
    return GRPOTrainer(model, rewards, args=config, processing_class=tokenizer,
                       train_dataset=rows, preference_dataset=preference, callbacks=callbacks)


def ppo_trainer(ctx, model, tokenizer, config, rows, rewards, callbacks):
    from stages.trainers.ppo_trainer import PPOTrainer

    return PPOTrainer(model, args=config, processing_class=tokenizer, train_dataset=rows, reward_funcs=rewards,
                      callbacks=callbacks)


class Method(NamedTuple):
    data: Callable  # ctx -> (rows, reward functions or None); checks everything before a model is loaded
    trainer: Callable  # (ctx, model, tokenizer, trainer config, rows, rewards, callbacks) -> Trainer


METHODS = {
    "dpo": Method(dpo_data, dpo_trainer),
    "kto": Method(kto_data, kto_trainer),
    "online_dpo": Method(online_data("online_dpo"), online_dpo_trainer),
    "grpo": Method(online_data("grpo"), grpo_trainer),
    "ppo": Method(online_data("ppo"), ppo_trainer),
}


def training_rows(params, manifests: dict[str, dict]) -> dict[str, Any] | None:
    """The rows (pairs, unpaired rows or prompts) `policy.method` trains on and one device's share of a step
    (`StageSpec.training_rows`, for the checks of `stages.harness.launch`); None before they are counted upstream."""
    p, method = params.policy, params.policy.method
    counted = manifests["preprocess"].get("metrics", {}).get("rows", {})
    per_device, unit = p.trained.per_device_train_batch_size, "rows"
    if method in ("grpo", "online_dpo", "ppo"):
        n, what = counted.get("prompts"), "prompts"
        if isinstance(n, int) and p.num_prompts > 0:
            n = min(n, p.num_prompts)
        if method == "grpo":  # the batch counts completions, num_generations per prompt
            per_device, unit = max(per_device // p.grpo.num_generations, 1), "prompts"
    else:
        n = manifests["score"].get("metrics", {}).get("pairs") if p.data == "score" else counted.get(
            "preference" if method == "dpo" else "unpaired")
        what = "pairs" if method == "dpo" else "rows"
    return None if not isinstance(n, int) else {"rows": n, "what": what, "per_device": per_device, "unit": unit,
                                                "batch_key": f"policy.{method}.per_device_train_batch_size"}
