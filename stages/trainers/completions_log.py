"""TRL's `log_completions` for the online trainers: a table of the latest generation's prompts, completions,
rewards and advantages, sent at every training log line to the trackers that show tables and printed.

Where it goes, by the callbacks the trainer has (`stages.trackers` makes them from `report_to`):
TensorBoard (a markdown table under the text tab "completions"), W&B (a `wandb.Table` "completions"), MLflow
(`mlflow.log_table`, artifact completions/step_<N>.json); and always the log (`num_completions_to_print` rows,
one per prompt with `log_unique_prompts`). `last` keeps the latest table.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class CompletionsLog:
    """Rows of the latest generation (`add`), logged and cleared by `flush`; does nothing unless log_completions."""

    def __init__(self, args):
        self.enabled = bool(getattr(args, "log_completions", False))
        self.to_print = getattr(args, "num_completions_to_print", None)
        self.unique = bool(getattr(args, "log_unique_prompts", False))
        self.rows: list[dict[str, Any]] = []
        self.last: list[dict[str, Any]] = []

    def add(self, prompts: list, completions: list[str], per_function: dict[str, list],
            advantages: list[float]) -> None:
        """One generation's rows (the latest generation replaces an earlier one not yet logged)."""
        if not self.enabled:
            return
        self.rows = [{"step": 0, "prompt": _text(p), "completion": c,
                      **{name: scores[i] for name, scores in per_function.items()}, "advantage": advantages[i]}
                     for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]

    def flush(self, step: int, callbacks: list) -> None:
        if not self.enabled or not self.rows:
            return
        rows, self.rows = [{**r, "step": step} for r in self.rows], []
        self.last = rows
        columns = list(rows[0])
        for cb in callbacks:
            _send(cb, step, columns, rows)
        shown = rows
        if self.unique:
            shown = list({r["prompt"]: r for r in reversed(rows)}.values())[::-1]  # each prompt's first row
        if self.to_print is not None:
            shown = shown[:self.to_print]
        if shown:
            logger.info("completions at step %d:\n%s", step, markdown(columns, shown))


def markdown(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A markdown table; cells on one line, floats to 4 significant digits."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _text(prompt: Any) -> str:
    """A prompt as one string: plain text as it is, a conversation as its last user message."""
    if isinstance(prompt, list):
        return next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), str(prompt))
    return str(prompt)


def _send(cb, step: int, columns: list[str], rows: list[dict[str, Any]]) -> None:
    """The table to one tracker callback, when it is one that shows tables and is active."""
    writer = getattr(cb, "tb_writer", None)
    if writer is not None:
        writer.add_text("completions", markdown(columns, rows), step)
        return
    wandb = getattr(cb, "_wandb", None)
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.log({"completions": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                  step=step)
        return
    mlflow = getattr(cb, "_ml_flow", None)
    if mlflow is not None and getattr(cb, "_initialized", False):
        mlflow.log_table(data={c: [r[c] for r in rows] for c in columns},
                         artifact_file=f"completions/step_{step}.json")
