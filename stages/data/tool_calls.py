"""Tool-calling data: the checks and conversions of `tools` columns, assistant `tool_calls` and `tool` turns.

The shape is Hugging Face's and OpenAI's (what transformers' chat templates and TRL take):

- an assistant message may carry `tool_calls: [{"type": "function", "function": {"name": str, "arguments":
  {...} or a JSON string}}]`, its `content` then None, missing, or text said before the calls;
- a tool's result is a message `{"role": "tool", "content": str}` (`name` and `tool_call_id` optional), after
  the assistant turn whose call it answers, one per call;
- a row's `tools` column lists the functions the model may call, each a JSON schema `{"type": "function",
  "function": {"name": str, "description": str, "parameters": {JSON schema object}}}`; the column may also be
  one JSON string of that list (what a `datasets.Dataset` keeps exactly, where Arrow would merge the schemas'
  fields), and in the Python API a tool may be a Python function (transformers' `get_json_schema` reads its
  signature and docstring).

Each `*_problem` function returns '' or why the value is wrong, naming the field; `tool_schemas` and
`parsed_messages` turn valid values into what a chat template takes. Pure: no tokenizer, no I/O.
"""
from __future__ import annotations

import json
from typing import Any

TOOL_SCHEMA_SHAPE = ('{"type": "function", "function": {"name": "<name>", "description": "<what it does>", '
                     '"parameters": {"type": "object", "properties": {...}}}}')
TOOL_CALL_SHAPE = '{"type": "function", "function": {"name": "<name>", "arguments": {...}}}'


def uses_tools(messages: list[dict] | None, tools: Any = None) -> bool:
    """Whether a conversation (or a row's `tools` value) involves tools: a tools list, a tool call, a tool turn."""
    return bool(tools) or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                              for m in messages or [])


def row_uses_tools(row: dict[str, Any]) -> bool:
    """Whether any conversation field of a row, or its `tools` column, involves tools."""
    return bool(row.get("tools")) or any(
        isinstance(row.get(k), list) and uses_tools(row[k]) for k in ("messages", "prompt", "completion", "chosen",
                                                                      "rejected"))


# ---------------------------------------------------------------------------------------- the `tools` column

def _json(text: str) -> tuple[Any, str]:
    """(the parsed value, '') of a JSON string, or (None, where it fails: "<message> at character <n>")."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at character {e.pos}"


def tools_problem(value: Any, name: str = "tools") -> str:
    """'' if `value` is a valid `tools` column (None, a list of schemas or Python functions, or that list as a
    JSON string), else why not, naming the entry."""
    if value is None:
        return ""
    if isinstance(value, str):
        value, bad = _json(value)
        if bad:
            return f"field '{name}' is a string but not JSON ({bad}); give a list of tool schemas, or that list as a " \
                   "JSON string"
    if not isinstance(value, list):
        return f"field '{name}' must be a list of tool schemas, got {type(value).__name__}"
    for i, tool in enumerate(value):
        why = _schema_problem(tool)
        if why:
            return f"field '{name}[{i}]' is not a tool schema: {why}; expected {TOOL_SCHEMA_SHAPE}"
    return ""


def _schema_problem(tool: Any) -> str:
    if callable(tool):
        return ""
    if not isinstance(tool, dict):
        return f"got {type(tool).__name__} {_short(tool)}"
    if tool.get("type") != "function":
        return f"'type' is {tool.get('type')!r}, not 'function'"
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return f"'function' must be an object, got {_short(fn)}"
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        return f"'function.name' must be a non-empty string, got {_short(fn.get('name'))}"
    if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
        return f"'function.description' must be a string, got {type(fn['description']).__name__}"
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        return f"'function.parameters' must be a JSON schema object (type object), got {_short(params)}"
    return ""


def tool_schemas(tools: Any) -> list[dict] | None:
    """A valid `tools` value as chat templates take it: a list of JSON schemas (JSON strings parsed, Python
    functions through transformers' `get_json_schema`), or None when there are none (`[]` too: some templates,
    Llama 3.1's, write their tool preamble for an empty list)."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    if not tools:
        return None
    if any(callable(t) for t in tools):
        from transformers.utils import get_json_schema

        return [get_json_schema(t) if callable(t) else t for t in tools]
    return list(tools)


# ---------------------------------------------------------------------------------------- messages

def message_problem(field: str, message: dict) -> str:
    """'' if one message's content and tool fields are valid for its role, else why not. `field` names the
    message (`"completion[1]"`). The role itself is checked by the caller."""
    role, content = message["role"], message.get("content")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        return f"field '{field}' has tool_calls but role {role!r}; only assistant messages call tools"
    if role == "assistant" and calls:
        if content is not None and not isinstance(content, str):
            return f"field '{field}.content' must be a string or null, got {type(content).__name__}"
        return tool_calls_problem(f"{field}.tool_calls", calls)
    if calls is not None and not isinstance(calls, list):
        return f"field '{field}.tool_calls' must be a list of tool calls, got {type(calls).__name__}"
    if not isinstance(content, str):
        got = "none" if "content" not in message else type(content).__name__
        need = " (or tool_calls)" if role == "assistant" else ""
        return f"field '{field}.content' must be a string{need}, got {got}"
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                return f"field '{field}.{key}' must be a string, got {type(message[key]).__name__}"
    return ""


def tool_calls_problem(field: str, calls: Any) -> str:
    """'' if `calls` is a valid non-empty list of tool calls, else why not (naming the call)."""
    if not isinstance(calls, list):
        return f"field '{field}' must be a list of tool calls, got {type(calls).__name__}"
    for i, call in enumerate(calls):
        where = f"{field}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return f"field '{where}' must be a tool call {TOOL_CALL_SHAPE}, got {_short(call)}"
        if call.get("type", "function") != "function":
            return f"field '{where}.type' is {call['type']!r}; tool calls are of type 'function'"
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            return f"field '{where}.function.name' must be the called function's name, got {_short(fn.get('name'))}"
        args = fn.get("arguments")
        if isinstance(args, str):
            args, bad = _json(args)
            if bad:
                return (f"field '{where}.function.arguments' is not JSON ({bad}: {_short(fn['arguments'])}); give an "
                        "object of arguments, or one as a JSON string")
        if not isinstance(args, dict):
            return (f"field '{where}.function.arguments' must be an object of arguments (or one as a JSON "
                    f"string), got {_short(fn.get('arguments'))}")
    return ""


def tool_turns_problem(parts: list[tuple[str, list[dict]]]) -> str:
    """'' if every tool message of a conversation answers a call, else why not.

    parts: the conversation as consecutive (field name, messages), e.g. [("prompt", ...), ("completion", ...)].
    A tool message must follow an assistant message with tool_calls (or another tool message after it), with
    at most one tool message per call; one with a `name` must name a function that turn called.
    """
    pending: list[str] = []  # names of the latest assistant turn's calls not answered yet
    for field, messages in parts:
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                if not pending:
                    return (f"field '{field}[{i}]' is a tool message with no preceding tool call: it must follow "
                            "an assistant message with tool_calls (one tool message per call); add the call, or "
                            "drop the tool message")
                name = m.get("name")
                if name is not None and name not in pending:
                    return (f"field '{field}[{i}].name' = {name!r} answers no call of the assistant turn before it "
                            f"(it called {', '.join(sorted(set(pending)))})")
                pending.remove(name if name is not None else pending[0])
            else:
                pending = [c["function"]["name"] for c in m.get("tool_calls") or []]
    return ""


def parsed_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: tool-call arguments given as JSON strings parsed into objects (a
    template writes `arguments | tojson`, which would quote a string again). Others are returned as they are."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and any(isinstance(c["function"].get("arguments"), str) for c in calls):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                if isinstance(c["function"].get("arguments"), str) else c for c in calls]}
        out.append(m)
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
