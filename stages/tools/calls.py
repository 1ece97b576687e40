"""A completion's tool calls, parsed in its chat template's format.

A parsed turn is an assistant message in the shape the chat templates render (TRL's and transformers'):

    {"role": "assistant", "content": str | None,
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}]}

plus `errors`: one message per call that could not be read (bad JSON, no name, arguments not an object, an
unclosed tag). A malformed call is never silently dropped and never crashes anything: the episode loop answers
it with a parse-error `tool` turn (`stages.tools.runner.ToolRunner.parse_error`), so the model learns from it.

Formats (`FORMATS`):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn, text around them
  is the content (Qwen2.5, Hermes, align's `stages.builtin.chat_templates.CHATML_TOOLS`).
- "llama3_json": Llama 3.1/3.2's JSON tool call, the whole turn one object `{"name": ..., "parameters": {...}}`
  (one call per turn; "arguments" is read too).
`format_for_template` picks one from the chat template's text.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedTurn:
    """One assistant turn: its text outside the calls, the calls (TRL's shape) and the calls that failed to parse."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """Whether the turn asked for a tool (well-formed or not): the episode continues with tool turns."""
        return bool(self.tool_calls or self.errors)

    def message(self) -> dict:
        """The assistant message; content None when the turn is only calls (the shared message format)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.tool_calls
                               else None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _call(name: Any, arguments: Any, where: str) -> tuple[dict | None, str | None]:
    """(a tool call in TRL's shape, None) or (None, why it is malformed)."""
    if not isinstance(name, str) or not name:
        return None, f"{where}: no \"name\" string"
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None, f"{where} ({name}): \"arguments\" is a string that is not JSON: {arguments[:200]!r}"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f"{where} ({name}): \"arguments\" must be a JSON object, got {type(arguments).__name__}"
    return {"type": "function", "function": {"name": name, "arguments": arguments}}, None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks; the rest of the text is the content."""
    calls: list[dict] = []
    errors: list[str] = []
    kept: list[str] = []
    end = 0
    for k, match in enumerate(_HERMES.finditer(text), 1):
        kept.append(text[end:match.start()])
        end = match.end()
        call, error = _hermes_call(match.group(1).strip(), k)
        if call is not None:
            calls.append(call)
        else:  # a malformed call stays in the content: the transcript shows what the model wrote
            errors.append(str(error))
            kept.append(match.group(0))
    tail = text[end:]
    if "<tool_call>" in tail:
        errors.append(f"an unclosed <tool_call>: {tail[tail.index('<tool_call>'):][:200]!r}")
    kept.append(tail)
    return ParsedTurn("".join(kept).strip(), calls, errors)


def _hermes_call(body: str, k: int) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return None, f"tool call {k}: invalid JSON ({e}): {body[:200]!r}"
    if not isinstance(obj, dict):
        return None, (f"tool call {k}: expected a JSON object {{\"name\": ..., \"arguments\": {{...}}}}, got "
                      f"{type(obj).__name__}")
    return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")), f"tool call {k}")


def parse_llama3_json(text: str) -> ParsedTurn:
    """The whole turn as one JSON call `{"name": ..., "parameters": {...}}`; anything else is content."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not re.match(r'\{\s*"name"\s*:', body):
        return ParsedTurn(text.strip())
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ParsedTurn(text.strip(), errors=[f"tool call 1: invalid JSON ({e}): {body[:200]!r}"])
    if not isinstance(obj, dict):  # pragma: no cover - the regex above saw an object start
        return ParsedTurn("", errors=["tool call 1: not a JSON object"])
    call, error = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")), "tool call 1")
    return ParsedTurn("", [call] if call is not None else [], [str(error)] if call is None else [])


FORMATS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    """The tool calls of one decoded assistant turn (special tokens such as EOS already removed)."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r}: unknown; supported: {', '.join(FORMATS)}")
    return FORMATS[fmt](text)


def format_for_template(chat_template: str | None, *, owner: str = "the tokenizer") -> str:
    """The `FORMATS` key a chat template writes tool calls in; a ValueError when it renders none we read."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template or "<|python_tag|>" in template:
        return "llama3_json"
    raise ValueError(f"{owner}'s chat template renders no tool calls in a format align parses ({', '.join(FORMATS)}:"
                     " <tool_call>{json}</tool_call>, or Llama 3.1's {\"name\": ..., \"parameters\": ...}); set "
                     "chat_template_path to one that does, e.g. stages.builtin.chat_templates.CHATML_TOOLS for a "
                     "ChatML tokenizer")
