"""What a wrong answer to the built-in task got wrong: the labellers' own slip, or another.

A benchmark's diagnostic (benchmarks/alignment.py tables it per model), apart from the task's
generator so that no stage's code, and so no fingerprint, depends on it.
"""
from __future__ import annotations

from stages.builtin.arithmetic import THINK_CLOSE, THINK_OPEN, add, needs_carry

ERROR_KINDS = ("dropped carry", "carry written, wrong sum", "right steps, wrong answer", "other step error",
               "no reasoning block")


def error_kind(a: int, b: int, completion: str) -> str | None:
    """What is wrong with a reasoning-variant `completion` of a+b (None: it is right), one of ERROR_KINDS:
    the labellers' own error (every carry dropped), a carry written whose column sum still drops it
    ("9+5+1=14"), column sums right but the answer not theirs, any other slip in the column sums, or no
    `<think>...</think>` block followed by an answer."""
    head, sep, answer = completion.partition(THINK_CLOSE)
    if not (sep and head.startswith(THINK_OPEN)):
        return "no reasoning block"
    steps, (value, right_steps) = head[len(THINK_OPEN):], add(a, b)
    if steps == right_steps:
        return None if answer.strip() == str(value) else "right steps, wrong answer"
    if needs_carry(a, b) and steps == add(a, b, drop_carry=True)[1]:
        return "dropped carry"
    if needs_carry(a, b) and "+1=" in steps:
        return "carry written, wrong sum"
    return "other step error"
