"""What every training stage shares: trainer arguments, callbacks, resume, saving, trackers.

Each training stage (`sft`, `policy`, ...) builds its own model, data and trainer; these
helpers keep checkpoints, crash-resume, TensorBoard and the saved outputs identical.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from transformers import PrinterCallback
from transformers.trainer_utils import get_last_checkpoint

from stages import trackers
from stages.harness import model_card
from stages.models import load_causal_lm
from stages.precision import mixed_precision, trainer_precision
from stages.sharding import unwrap
from stages.trainers.adapters import apply_lora, quantization_config, trainable_fraction
from stages.trainers.callbacks import LogToLogger, NumericGuard


def load_trainable_model(path: str, p, s, *, device: str, section: str, load=load_causal_lm,
                         task_type: str = "CAUSAL_LM"):
    """The model a training stage starts from, from its params section `s` (`section`: its name in params.yaml):
    loaded by `load` (quantised for QLoRA: `s.lora.quantization`, refused before loading where it cannot
    work), activation checkpointing (`s.gradient_checkpointing`, every `s.gradient_checkpointing_every`-th
    block), LoRA adapters if `s.lora.enabled` (PEFT `task_type`). -> (model, trainable, total).

    The weights load at model.dtype; mixed precision is autocast around the forward (`trainer_args`), so
    with model.dtype float32 the optimizer keeps fp32 master weights."""
    quantization = quantization_config(s.lora, device=device, key=f"{section}.lora.quantization")
    model = load(path, dtype=p.model.dtype, device=device, trust_remote_code=p.model.trust_remote_code,
                 quantization_config=quantization)
    if s.gradient_checkpointing or s.activation_checkpointing:  # TRL's name, or transformers' new one
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=s.gradient_checkpointing_every)
    if s.lora.enabled:
        model = apply_lora(model, s.lora, task_type=task_type)
    return (model, *trainable_fraction(model))


def trainer_config(ctx, s, *, device: str, section: str, **pipeline: Any):
    """The stage's trainer config (`s.CONFIG`, e.g. stages.trainers.dpo_config:DPOConfig) from its params section
    `s`, which holds every field of it, and the keys the pipeline sets (PIPELINE_KEYS; `pipeline` adds a stage's
    own). Built before any model: a value transformers refuses is reported by its dotted key."""
    import importlib

    from stages.trainers.arguments import real_kwargs

    module, _, name = s.CONFIG.partition(":")
    config_cls = getattr(importlib.import_module(module), name)
    check_trackers(s.report_to, section)
    precision = mixed_precision(s.mixed_precision, device, section)
    kwargs = {**real_kwargs(s, config_cls),
              "output_dir": str(ctx.work / "checkpoints"), "seed": ctx.params.run.seed,
              "data_seed": ctx.params.run.seed, "use_cpu": device == "cpu",
              "logging_nan_inf_filter": False,  # transformers would log the running mean: NumericGuard must see a NaN
              "save_strategy": "steps", "disable_tqdm": True,  # LogToLogger reports progress with an ETA
              **trackers.tracker_args(ctx, section, s.report_to),  # report_to (those transformers builds), run_name
              # load_trainable_model checkpoints every gradient_checkpointing_every-th block, not the Trainer
              "gradient_checkpointing": None, "activation_checkpointing": None,
              # accelerate wraps the forward in torch.autocast and casts its outputs back to fp32
              "bf16": precision == "bf16", "fp16": precision == "fp16", **pipeline}
    try:
        return config_cls(**kwargs)
    except ValueError as e:
        raise ValueError(refused(section, e, kwargs)) from None


def refused(section: str, error: ValueError | TypeError, kwargs: dict[str, Any]) -> str:
    """transformers' (or a config's) refusal, reworded with the dotted keys it names."""
    message = " ".join(str(error).split())
    keys = [k for k in kwargs if k in message] or ["(a training argument)"]
    return (f"{', '.join(f'{section}.{k}' for k in keys[:3])}: refused by {section}'s trainer config: {message}; "
            f"fix it in params.yaml or with --set")


def precision_report(trainer) -> dict[str, Any]:
    """How the stage computed, read from the trained objects (for its manifest): the autocast, whether
    activation checkpointing was on, and the dtype of the trained (master) weights."""
    model = trainer.model
    inner = unwrap(model)
    inner = getattr(inner, "pretrained_model", inner)  # PPO's value-head wrapper
    trained = {str(w.dtype).removeprefix("torch.") for w in model.parameters() if w.requires_grad}
    return {"mixed_precision": trainer_precision(trainer.args),
            "gradient_checkpointing": bool(getattr(inner, "is_activation_checkpointing", False)),
            "trained_weights_dtype": ",".join(sorted(trained))}


def callbacks(ctx, report_to: list[str] | str | None) -> tuple[LogToLogger, list]:
    """(the log forwarder, every callback of a training stage): logs, the NaN/Inf guard, the trackers of
    `report_to` (null: run.report_to) that stages.trackers makes (TensorBoard, MLflow, DVCLive, W&B)."""
    logger = LogToLogger(ctx.log)
    return logger, [logger, NumericGuard(), *trackers.callbacks(ctx, ctx.stage, report_to)]


def complete_checkpoint(folder: Path) -> bool:
    """Whether a Trainer checkpoint folder was fully written (a SIGKILL mid-save leaves a partial one).

    transformers writes trainer_state.json after the weights, optimizer, scheduler and RNG states
    (whatever their layout: safetensors, an adapter, FSDP shards); one that parses and names this
    step marks a complete checkpoint.
    """
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return folder.name == f"checkpoint-{state.get('global_step')}"


def last_checkpoint(ctx, max_steps: int = -1) -> str | None:
    """The last complete checkpoint a crashed attempt with the same fingerprint left behind, if any.

    transformers writes checkpoints in place, so a run killed while saving leaves a partial
    `checkpoint-N`; it is removed (with a warning) and the previous complete one is used. So is a
    checkpoint at `max_steps` (> 0; a run killed after its last save): resumed from, transformers
    takes one step past max_steps (its stop check follows a step), which adds a step to the log and
    the loss curve; going back to the checkpoint before it ends in the same bytes as a run never killed.
    """
    folder = ctx.work / "checkpoints"
    while folder.is_dir() and (found := get_last_checkpoint(str(folder))):
        if not complete_checkpoint(Path(found)):
            ctx.log.warning("removing %s: incomplete (the run was killed while saving it)", found)
        elif 0 < max_steps <= int(Path(found).name.rsplit("-", 1)[1]):
            ctx.log.info("removing %s: saved at the last step; resuming there would train one step more", found)
        else:
            return found
        shutil.rmtree(found)
    return None


def train(trainer, ctx) -> tuple[Any, str | None]:
    trainer.remove_callback(PrinterCallback)  # LogToLogger already reports every log line
    resume = last_checkpoint(ctx, trainer.args.max_steps)
    if resume:
        ctx.log.info("resuming from %s", resume)
    return trainer.train(resume_from_checkpoint=resume), resume


def save_outputs(trainer, tokenizer, ctx) -> None:
    """model/ (full model or adapter, with tokenizer, chat template and model card), log_history.json,
    tensorboard/; ends the stage's tracker runs."""
    trainer.save_model(str(ctx.out / "model"))  # on every rank: FSDP / ZeRO-3 gather the weights; rank 0 writes
    trackers.finish(trainer)
    if not trainer.is_world_process_zero():
        return
    # a pickle of the TrainingArguments that nothing reads (the manifest has the params): no pickles in artifacts
    (ctx.out / "model" / "training_args.bin").unlink(missing_ok=True)
    tokenizer.save_pretrained(str(ctx.out / "model"))
    (ctx.out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
    if (ctx.work / "tensorboard").is_dir():
        shutil.copytree(ctx.work / "tensorboard", ctx.out / "tensorboard")
    model_card.write_stage_card(ctx, ctx.out / "model", eval_metrics=model_card.last_eval(trainer.state.log_history))


def check_trackers(report_to: list[str] | str | None, section: str) -> None:
    """Params validation refuses these first (stages.trackers.problems); a stage called with other params too."""
    found = [msg for _, msg in trackers.problems_of(report_to, f"{section}.report_to")]
    if found:
        raise ValueError(f"{section}.report_to " + "; ".join(found))
