"""Trainer callbacks shared by every training stage."""
from __future__ import annotations

import logging

from transformers import TrainerCallback


class LogToLogger(TrainerCallback):
    """Forward the Trainer's logs to a stdlib logger (the Prefect task shows them in the UI)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.history: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        self.history.append({"step": state.global_step, **logs})
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())
        self.logger.info("step %d/%d: %s", state.global_step, state.max_steps, shown)


def tensorboard_callback(log_dir):
    """TensorBoard logs into `log_dir` (transformers' own callback otherwise writes under output_dir/runs)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(log_dir)))
