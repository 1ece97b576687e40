"""Stage `policy`: optimise the SFT model with one method (`policy.method`, or none to skip).

The methods are the policy records of `stages.methods` (docs/methods.md describes each). A record's kind
says what the method trains on (`method_rows`): offline pairs (score's sampled-and-scored pairs, or
preprocess's preference data; reference log-probs from stage `reference` when precomputed), unpaired rows
(preprocess's unpaired data, or the pairs split), or prompts it samples from during training with the
section's reward functions (online and RL methods), through the tools it names (`policy.grpo.tools`: episodes
that call them, `stages.tools`). Its trainer is called as TRL's (`build_trainer`).
Every method starts from the SFT model, which is also the frozen reference (or, with
`policy.<method>.lora`, the same weights with the adapter disabled). Checkpoints and crash-resume as
in `sft`. Writes `model/`, `tensorboard/` and `log_history.json`.

    python -m stages policy [--set policy.dpo.beta=0.2] [--set policy.method=grpo]
"""
from __future__ import annotations

import importlib
from typing import Any

from stages.data import read_jsonl
from stages.methods import METHODS, Method
from stages.models import load_tokenizer, pick_device
from stages.pipeline import reference, training
from stages.pipeline.prompts import preference_pairs, prompt_rows, reward_model_path, unpaired_rows
from stages.reward_functions import build_reward_functions
from stages.tools.paths import resolve_tool


def run(ctx) -> dict[str, Any]:
    p, pol = ctx.params, ctx.params.policy
    s, section = pol.trained, f"policy.{pol.method}"
    if pol.method == "none":
        ctx.log.info("policy: method none, no policy optimisation; evaluate reports base and SFT only")
        return {"method": "none"}
    method = METHODS[pol.method]
    device = pick_device(p.run.device)
    start = str(ctx.inputs["sft"] / "model")
    tokenizer = load_tokenizer(start, trust_remote_code=p.model.trust_remote_code)
    rows, rewards = method_rows(ctx, method)  # data, reward functions and the trainer config checked before any model
    config = training.trainer_config(ctx, s, device=device, section=section)
    model, trainable, total = training.load_trainable_model(start, p, s, device=device, section=section)
    logger, callbacks = training.callbacks(ctx, s.report_to)
    trainer = build_trainer(ctx, method, model, tokenizer, config, rows, rewards, callbacks)
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


def method_rows(ctx, method: Method) -> tuple[list[dict], list | None]:
    """(rows, reward functions or None) of what `method` trains on (Method.data); everything is checked here,
    before a model is loaded."""
    pol = ctx.params.policy
    if method.data == "pairs":
        if reference.needed(pol) is None:  # stage reference computed the pairs with their reference log-probs
            rows = read_jsonl(ctx.inputs["reference"] / "pairs.jsonl")
            ctx.log.info("policy: reference log-probs of %d pairs from stage reference (no reference forward)",
                         len(rows))
            return rows, None
        return preference_pairs(ctx, pol.data)[1], None
    if method.data == "unpaired":
        return unpaired_rows(ctx, pol.data), None
    if not method.scores:  # a teacher's distributions are the target (checked in teacher_path)
        teacher_path(ctx, method)
        return prompt_rows(ctx, pol.num_prompts), None
    s, device = pol.trained, pick_device(ctx.params.run.device)
    rewards = build_reward_functions(s.reward_functions, key=f"{method.section}.reward_functions",
                                     reward_model_path=reward_model_path(ctx), device=device)
    return prompt_rows(ctx, pol.num_prompts), rewards.functions  # the trainer applies reward_weights


def teacher_path(ctx, method: Method) -> str:
    """The folder of the section's teacher_model_name_or_path (a builtin: model built or dequantised once, as
    model.name_or_path is), after checking that its tokenizer is the student's (the SFT model's): the teacher
    scores the student's token ids as they are."""
    from stages.harness.config import ModelConfig
    from stages.harness.model_paths import resolve_model

    p = ctx.params
    key, given = f"{method.section}.teacher_model_name_or_path", p.policy.trained.teacher_model_name_or_path
    path = str(resolve_model(ModelConfig(name_or_path=given), p.run.output_dir)) if str(given).startswith(
        "builtin:") else str(given)
    student = load_tokenizer(str(ctx.inputs["sft"] / "model"), trust_remote_code=p.model.trust_remote_code)
    teacher = load_tokenizer(path, trust_remote_code=p.model.trust_remote_code)
    if teacher.get_vocab() != student.get_vocab():
        raise ValueError(f"{key} = {given!r}: its tokenizer differs from the student's (the SFT model of "
                         f"{p.model.name_or_path}): {len(teacher)} tokens against {len(student)}, or other ids; the "
                         "teacher scores the student's token ids, so it must share the tokenizer (e.g. a merged "
                         "policy of an earlier run on the same base model)")
    return path


def build_trainer(ctx, method: Method, model, tokenizer, config, rows, rewards, callbacks):
    """The method's trainer (Method.trainer), called as TRL's: the reward functions of a method that samples as
    `reward_funcs`; a config asking for a shared reward head (GRPO's reward_head) also gets preference pairs."""
    module, _, name = method.trainer.partition(":")
    trainer_cls = getattr(importlib.import_module(module), name)
    kwargs: dict[str, Any] = {"args": config, "processing_class": tokenizer, "train_dataset": rows,
                              "callbacks": callbacks}
    if rewards is not None:
        kwargs["reward_funcs"] = rewards
    if method.teacher:
        kwargs["teacher_model"] = teacher_path(ctx, method)
    tools = [resolve_tool(path) for path in getattr(ctx.params.policy.trained, "tools", None) or []]
    if tools:  # each path resolved at params validation already
        kwargs["tools"] = tools
    if getattr(config, "reward_head", None) == "shared":
        kwargs["preference_dataset"] = preference_pairs(ctx, "preprocess", key=f"{method.section}.reward_head")[1]
    return trainer_cls(model, **kwargs)


def training_rows(params, manifests: dict[str, dict]) -> dict[str, Any] | None:
    """The rows (pairs, unpaired rows or prompts) `policy.method` trains on and one device's share of a step
    (`StageSpec.training_rows`, for the checks of `stages.harness.launch`); None before they are counted upstream."""
    p, method = params.policy, METHODS[params.policy.method]
    counted = manifests["preprocess"].get("metrics", {}).get("rows", {})
    per_device, unit = p.trained.per_device_train_batch_size, "rows"
    if method.data == "prompts":
        n, what = counted.get("prompts"), "prompts"
        if isinstance(n, int) and p.num_prompts > 0:
            n = min(n, p.num_prompts)
        if getattr(p.trained, "num_generations", None):  # the batch counts completions, num_generations per prompt
            per_device, unit = max(per_device // p.trained.num_generations, 1), "prompts"
    else:
        n = manifests["score"].get("metrics", {}).get("pairs") if p.data == "score" else counted.get(
            "preference" if method.data == "pairs" else "unpaired")
        what = "pairs" if method.data == "pairs" else "rows"
    return None if not isinstance(n, int) else {"rows": n, "what": what, "per_device": per_device, "unit": unit,
                                                "batch_key": f"{method.section}.per_device_train_batch_size"}
