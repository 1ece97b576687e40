"""Dataset formats people already have, detected, validated and normalised.

| format            | fields                                  | becomes                          |
|-------------------|-----------------------------------------|----------------------------------|
| messages          | messages                                | sft: prompt/completion (chat)    |
| prompt_completion | prompt, completion                      | sft: prompt/completion           |
| alpaca            | instruction, [input], output, [system]  | sft: prompt/completion (chat)    |
| text              | text                                    | sft: text                        |
| preference        | [prompt], chosen, rejected              | preference: prompt/chosen/rejected |
| unpaired          | prompt, completion, label               | unpaired: prompt/completion/label  |
| prompt_only       | prompt, [answer...]                     | prompts                          |

Prompts and completions are either strings or lists of chat messages
(`{"role": ..., "content": ...}`). Conversations may use tools (`stages.data.tool_calls`): assistant
messages with `tool_calls`, `tool` messages with the results, and a `tools` column of JSON schemas; a
prompt may then end with a tool's result, and a `messages` row whose model turns use tools is split
after its last user message, so its completion holds every call, result and answer of that reply.
Columns beyond the format's own are kept as they are.
"""
from __future__ import annotations

from typing import Any

from stages.data.tool_calls import message_problem, tool_turns_problem, tools_problem, uses_tools

ROLES = ("system", "user", "assistant", "tool")

# format -> (required fields, optional fields, destination split); checked in this order
FORMATS: dict[str, tuple[frozenset, frozenset, str]] = {
    "preference": (frozenset({"chosen", "rejected"}), frozenset({"prompt"}), "preference"),
    "unpaired": (frozenset({"prompt", "completion", "label"}), frozenset(), "unpaired"),
    "prompt_completion": (frozenset({"prompt", "completion"}), frozenset(), "sft"),
    "messages": (frozenset({"messages"}), frozenset(), "sft"),
    "alpaca": (frozenset({"instruction", "output"}), frozenset({"input", "system"}), "sft"),
    "text": (frozenset({"text"}), frozenset(), "sft"),
    "prompt_only": (frozenset({"prompt"}), frozenset(), "prompts"),
}


def detect_format(row: dict[str, Any]) -> str | None:
    keys = set(row)
    for name, (required, _, _) in FORMATS.items():
        if required <= keys:
            return name
    return None


def describe_formats() -> str:
    return "; ".join(f"{n}: {', '.join(sorted(r))}" for n, (r, _, _) in FORMATS.items())


CONVERSATION_FIELDS = ("prompt", "chosen", "rejected", "completion", "messages")


def is_messages(value: Any) -> bool:
    """Whether one field value is a non-empty list of chat messages (dicts with a role and content or, for an
    assistant's tool calls, tool_calls)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m) for m in value))


def is_conversational(example: dict[str, Any]) -> bool:
    """Whether a row (a dict of fields, as TRL's `is_conversational(example)` takes) is conversational.

    True when one of its prompt / chosen / rejected / completion / messages fields holds a
    list of chat messages ({"role": ..., "content": ...}); False for plain strings and for
    rows with none of those fields. A field value instead of a row (the signature this
    function had before it followed TRL's) raises TypeError rather than silently answer False.
    """
    if not isinstance(example, dict):
        raise TypeError(f"is_conversational takes a row (a dict of fields), as TRL's does; got "
                        f"{type(example).__name__}. For one field value use is_conversational({{'prompt': value}}) "
                        "or stages.data.formats.is_messages(value)")
    return any(is_messages(example[k]) for k in CONVERSATION_FIELDS if k in example)


PROMPT_ENDS = ("user", "tool")  # a prompt asks, or hands the model a tool's result to go on from


def _check_messages(name: str, value: Any, *, last_role: str | tuple[str, ...] | None = None) -> str:
    if not isinstance(value, list) or not value:
        return f"field '{name}' must be a non-empty list of messages, got {type(value).__name__}"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or not ("content" in m or "tool_calls" in m):
            return f"field '{name}[{i}]' must be an object with 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"field '{name}[{i}].role' = {m['role']!r}: expected one of {', '.join(ROLES)}"
        why = message_problem(f"{name}[{i}]", m)
        if why:
            return why
    ends = (last_role,) if isinstance(last_role, str) else last_role
    last = value[-1]
    if ends and last["role"] not in ends:
        return (f"field '{name}' must end with a message of role {' or '.join(map(repr, ends))}, ends with "
                f"{last['role']!r}")
    if ends and not (last.get("content") or "").strip() and not last.get("tool_calls") and last["role"] != "tool":
        return f"field '{name}[{len(value) - 1}].content' is empty"
    return ""


def _check_text_or_messages(name: str, value: Any, *, last_role: str | tuple[str, ...]) -> str:
    if isinstance(value, str):
        return "" if value.strip() else f"field '{name}' is empty"
    if isinstance(value, list):
        return _check_messages(name, value, last_role=last_role)
    return f"field '{name}' must be a string or a list of messages, got {type(value).__name__}"


def _tool_problems(row: dict[str, Any], *conversations: tuple[str, ...]) -> str:
    """The `tools` column, and the tool turns of each conversation (fields read in order, e.g. prompt then
    completion: a result in the completion may answer a call in the prompt)."""
    why = tools_problem(row.get("tools"))
    for names in conversations:
        parts = [(n, row[n]) for n in names if isinstance(row.get(n), list)]
        why = why or tool_turns_problem(parts)
    return why


def _same_kind(row: dict[str, Any], *names: str) -> str:
    kinds = {isinstance(row[n], str) for n in names if n in row}
    return "" if len(kinds) <= 1 else f"fields {', '.join(names)} mix plain strings and message lists; use one form"


def validate(fmt: str, row: dict[str, Any]) -> str:
    """'' if the row is valid for `fmt`, else why not (naming the field)."""
    if fmt == "messages":
        err = _check_messages("messages", row["messages"], last_role="assistant")
        if not err and not any(m["role"] == "user" for m in row["messages"]):
            err = "field 'messages' has no user message"
        return err or _tool_problems(row, ("messages",))
    if fmt == "text":
        t = row["text"]
        return "" if isinstance(t, str) and t.strip() else "field 'text' must be a non-empty string"
    if fmt in ("prompt_completion", "unpaired"):
        err = (_check_text_or_messages("prompt", row["prompt"], last_role=PROMPT_ENDS)
               or _check_text_or_messages("completion", row["completion"], last_role="assistant")
               or _same_kind(row, "prompt", "completion"))
        if not err and fmt == "unpaired" and not isinstance(row["label"], bool):
            err = f"field 'label' must be true or false, got {row['label']!r}"
        return err or _tool_problems(row, ("prompt", "completion"))
    if fmt == "preference":
        err = (_check_text_or_messages("chosen", row["chosen"], last_role="assistant")
               or _check_text_or_messages("rejected", row["rejected"], last_role="assistant")
               or _same_kind(row, "prompt", "chosen", "rejected"))
        if not err and "prompt" in row:
            err = _check_text_or_messages("prompt", row["prompt"], last_role=PROMPT_ENDS)
        elif not err and isinstance(row["chosen"], str):
            err = "string-form preference rows need a 'prompt' field (or use message lists with a shared prefix)"
        return err or _tool_problems(row, ("prompt", "chosen"), ("prompt", "rejected"))
    if fmt == "alpaca":
        for name in ("instruction", "output"):
            if not isinstance(row[name], str) or not row[name].strip():
                return f"field '{name}' must be a non-empty string"
        for name in ("input", "system"):
            if row.get(name) is not None and not isinstance(row[name], str):
                return f"field '{name}' must be a string"
        return tools_problem(row.get("tools"))
    if fmt == "prompt_only":
        err = _check_text_or_messages("prompt", row["prompt"], last_role=PROMPT_ENDS)
        return err or _tool_problems(row, ("prompt",))
    raise ValueError(f"unknown format {fmt!r}")


def normalise(fmt: str, row: dict[str, Any]) -> dict[str, Any]:
    """A valid row in its destination's canonical form (extra columns kept)."""
    if fmt == "messages":
        extra = {k: v for k, v in row.items() if k != "messages"}
        msgs = row["messages"]
        cut = len(msgs) - 1
        if uses_tools(msgs):  # the reply to the last user turn, with its calls and their results
            cut = max(i for i, m in enumerate(msgs) if m["role"] == "user") + 1
        return {"prompt": msgs[:cut], "completion": msgs[cut:], **extra}
    if fmt == "alpaca":
        extra = {k: v for k, v in row.items() if k not in ("instruction", "input", "output", "system")}
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        prompt = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
        return {"prompt": prompt + [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": row["output"]}], **extra}
    if fmt == "preference" and "prompt" not in row:
        return {**row, **extract_shared_prompt(row["chosen"], row["rejected"])}
    return dict(row)


def extract_shared_prompt(chosen: list[dict], rejected: list[dict]) -> dict[str, Any]:
    """Conversations without an explicit prompt: the messages both share become the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}
