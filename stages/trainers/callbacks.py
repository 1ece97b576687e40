"""Trainer callbacks shared by every training stage."""
from __future__ import annotations

import logging
import math

from transformers import TrainerCallback

from stages.basics import Progress


class LogToLogger(TrainerCallback):
    """Forward the Trainer's progress and logs to a stdlib logger (the console, the log file, the Prefect task).

    Progress: a rate-limited line per `stages.basics` with step/total, steps/s, the ETA and the
    last logged loss (and rewards/accuracies when the trainer logs them). Every logged dict is
    kept in `history`; eval and end-of-training lines are logged in full, the others at DEBUG
    (the log file has them, the console is left to the progress line).
    """

    SHOWN = ("loss", "reward", "accuracy", "kl")  # metrics a progress line carries (key contains one)

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.history: list[dict[str, float]] = []
        self.progress: Progress | None = None
        self.latest: dict[str, float] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.progress = Progress(self.logger, total=state.max_steps, unit="steps", what="step",
                                     start=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(state.global_step, **self.latest)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.finish(**self.latest)
            self.progress = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        self.history.append({"step": state.global_step, **logs})
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items()
                          if not k.endswith(("_runtime", "_per_second")))
        full = any(k.startswith(("eval", "train_")) for k in logs)
        self.logger.log(logging.INFO if full else logging.DEBUG, "step %d/%d: %s", state.global_step,
                        state.max_steps, shown)
        if not full:
            self.latest = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and "/" not in k
                           and any(s in k for s in self.SHOWN) and not k.endswith("_per_second")}


class NonFiniteError(FloatingPointError):
    """A NaN or Inf loss, gradient norm or weight: the stage stops, naming the step and the metric."""


class NumericGuard(TrainerCallback):
    """Stop training at the first NaN/Inf loss or grad_norm, and never save a checkpoint with NaN weights.

    `on_log` checks every logged loss (`loss`, `eval_loss`, any `*loss*` key) and `grad_norm`,
    so a bad value stops the stage within one logging interval. Before every checkpoint save
    (`on_step_end` runs after the save decision and before the save) the trainable weights are
    checked too, so even a NaN between two log lines never replaces the last good checkpoint:
    the rerun of a fixed config resumes from it. Raising from the callback ends `trainer.train()`
    before anything else is written; the runner reports the stage as failed.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = {k: v for k, v in (logs or {}).items()
               if ("loss" in k or k == "grad_norm") and isinstance(v, (int, float)) and not math.isfinite(v)}
        if bad:
            control.should_save = False
            shown = ", ".join(f"{k} = {v}" for k, v in bad.items())
            raise NonFiniteError(f"non-finite {shown} at step {state.global_step} (averaged over the last "
                                 f"{args.logging_steps} step(s)); training stopped, the last good checkpoint in "
                                 f"{args.output_dir} is kept. Lower the learning rate, check the data, or use "
                                 "float32/bf16 instead of fp16")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not control.should_save or model is None:
            return
        import torch

        for name, param in model.named_parameters():
            if param.requires_grad and not torch.isfinite(param.detach()).all():
                control.should_save = False
                raise NonFiniteError(f"non-finite weights in {name} after step {state.global_step}; the checkpoint "
                                     f"of this step was not saved and the last good one in {args.output_dir} is "
                                     "kept. Lower the learning rate, check the data, or use float32/bf16 "
                                     "instead of fp16")


class OnlineEval(TrainerCallback):
    """A small evaluation during training: every `every` optimizer steps, greedy completions of `rows`'
    prompts are scored by `score_fn` and the mean is logged as `name` (TensorBoard, log_history, the logger).

    `score_fn(prompts, completions, **columns) -> list[float | None]` is a reward function
    (`stages.reward_functions`; e.g. `exact_match`, which reads the rows' `answer` or reference `completion`);
    None scores (no reference) are left out of the mean. Generation goes through
    `stages.generation` (seeded, the trainer's RNG state untouched; the model's train mode restored).
    """

    def __init__(self, trainer, rows: list[dict], *, every: int, score_fn, max_new_tokens: int = 32,
                 batch_size: int = 64, name: str = "eval_exact_match"):
        if every < 1:
            raise ValueError(f"eval_steps = {every}: must be >= 1 to evaluate during training (0 turns it off)")
        if not rows:
            raise ValueError("online evaluation needs prompts: no rows given")
        self.trainer, self.rows, self.every, self.score_fn = trainer, rows, every, score_fn
        self.max_new_tokens, self.batch_size, self.name = max_new_tokens, batch_size, name
        self.history: list[tuple[int, float | None]] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 and state.is_world_process_zero:
            value = self.evaluate()
            self.history.append((state.global_step, value))
            if value is not None:  # Trainer.log itself: a trainer's own log() would flush its running metrics
                from transformers import Trainer

                should_log = control.should_log  # logging resets it: keep this step's own loss line
                Trainer.log(self.trainer, {self.name: value})
                self.trainer.control.should_log = control.should_log = should_log

    def evaluate(self) -> float | None:
        from stages import generation

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        prompts = [r["prompt"] for r in self.rows]
        gens = generation.generate(model, self.trainer.processing_class, prompts,
                                   generation.SamplingParams(max_new_tokens=self.max_new_tokens, seed=0),
                                   batch_size=self.batch_size)
        columns = {k: [r.get(k) for r in self.rows] for k in ("answer", "completion") if any(k in r for r in self.rows)}
        scores = [s for s in self.score_fn(prompts, gens.completions, reasoning=gens.reasoning, **columns)
                  if s is not None]
        return round(sum(scores) / len(scores), 4) if scores else None
