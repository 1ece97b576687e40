"""The tool-calling settings of the trainers that run multi-turn episodes (GRPO, distillation;
`stages.tools`): TRL 1.16's `max_tool_calling_iterations` and align's own fault handling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import param


@dataclass
class ToolFields:
    max_tool_calling_iterations: int | None = param(
        None, help="rounds of tool calls per episode at most (null: until an answer without calls or "
        "max_completion_length); used with the trainer's tools", check=lambda v: v >= 1, rule="must be >= 1 or null")
    tool_timeout: float | None = param(30.0, help="seconds a tool call may run before it is stopped and answered "
                                       "with a timeout error (null: no limit)", check=lambda v: v > 0,
                                       rule="must be > 0 or null")
    tool_mode: Literal["in_process", "subprocess"] = param(
        "in_process", help="where tools run: in_process (the training process, with its rights) or subprocess (a "
        "forked child per call, killed at tool_timeout: for code execution)")
