"""The built-in task with a calculator: `data.builtin.tools: true`.

The tool is `add(a, b)`. A demonstration that uses it is four turns: the user's sum, the
assistant's call, the tool's result, and the assistant's answer, which copies the result:

    user       47+85
    assistant  tool_calls: add(a=47, b=85)
    tool       132
    assistant  132

The labellers stay imperfect the way `stages.builtin.arithmetic` describes, in a way only a tool
fixes: in a fraction `error_rate` of the sums that need a carry they skip the call and answer by
hand, dropping the carry. SFT learns to call the tool most of the time; an RL stage whose rollouts
run the tool (`policy.grpo.tools: [stages.builtin.arithmetic_tools.add]`) can learn to call it always.
Prompt rows and held-out rows carry the tool's schema in a `tools` column, so a chat template
renders it and a rollout knows what the model may call.
"""
from __future__ import annotations

from typing import Any


def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


# transformers.utils.get_json_schema(add), written out so the task builds without importing transformers
# (tests/stages/builtin/test_arithmetic_tools.py checks they agree)
ADD_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add", "description": "Add two integers and return their sum.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "integer", "description": "the second number"}}},
        "return": {"type": "integer"},
    },
}
TOOL_PATH = f"{__name__}.add"  # how params name it: policy.grpo.tools


def call(a: int, b: int) -> dict[str, Any]:
    """The assistant turn that calls `add(a, b)`."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}


def result(value: int) -> dict[str, Any]:
    return {"role": "tool", "name": "add", "content": str(value)}


def with_tool(user: list[dict[str, Any]], a: int, b: int, answer: str) -> list[dict[str, Any]]:
    """A whole episode that uses the tool: user, call, result, answer."""
    return [*user, call(a, b), result(add(a, b)), {"role": "assistant", "content": answer}]
