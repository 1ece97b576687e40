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
(`{"role": ..., "content": ...}`). Columns beyond the format's own are kept as they are.
"""
from __future__ import annotations

from typing import Any

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
    """Whether one field value is a non-empty list of chat messages (dicts with role and content)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


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


def _check_messages(name: str, value: Any, *, last_role: str | None = None) -> str:
    if not isinstance(value, list) or not value:
        return f"field '{name}' must be a non-empty list of messages, got {type(value).__name__}"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"field '{name}[{i}]' must be an object with 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"field '{name}[{i}].role' = {m['role']!r}: expected one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"field '{name}[{i}].content' must be a string, got {type(m['content']).__name__}"
    if last_role and value[-1]["role"] != last_role:
        return f"field '{name}' must end with a message of role {last_role!r}, ends with {value[-1]['role']!r}"
    if last_role and not value[-1]["content"].strip():
        return f"field '{name}[{len(value) - 1}].content' is empty"
    return ""


def _check_text_or_messages(name: str, value: Any, *, last_role: str) -> str:
    if isinstance(value, str):
        return "" if value.strip() else f"field '{name}' is empty"
    if isinstance(value, list):
        return _check_messages(name, value, last_role=last_role)
    return f"field '{name}' must be a string or a list of messages, got {type(value).__name__}"


def _same_kind(row: dict[str, Any], *names: str) -> str:
    kinds = {isinstance(row[n], str) for n in names if n in row}
    return "" if len(kinds) <= 1 else f"fields {', '.join(names)} mix plain strings and message lists; use one form"


def validate(fmt: str, row: dict[str, Any]) -> str:
    """'' if the row is valid for `fmt`, else why not (naming the field)."""
    if fmt == "messages":
        err = _check_messages("messages", row["messages"], last_role="assistant")
        if not err and not any(m["role"] == "user" for m in row["messages"]):
            err = "field 'messages' has no user message"
        return err
    if fmt == "text":
        t = row["text"]
        return "" if isinstance(t, str) and t.strip() else "field 'text' must be a non-empty string"
    if fmt in ("prompt_completion", "unpaired"):
        err = (_check_text_or_messages("prompt", row["prompt"], last_role="user")
               or _check_text_or_messages("completion", row["completion"], last_role="assistant")
               or _same_kind(row, "prompt", "completion"))
        if not err and fmt == "unpaired" and not isinstance(row["label"], bool):
            err = f"field 'label' must be true or false, got {row['label']!r}"
        return err
    if fmt == "preference":
        err = (_check_text_or_messages("chosen", row["chosen"], last_role="assistant")
               or _check_text_or_messages("rejected", row["rejected"], last_role="assistant")
               or _same_kind(row, "prompt", "chosen", "rejected"))
        if not err and "prompt" in row:
            err = _check_text_or_messages("prompt", row["prompt"], last_role="user")
        elif not err and isinstance(row["chosen"], str):
            err = "string-form preference rows need a 'prompt' field (or use message lists with a shared prefix)"
        return err
    if fmt == "alpaca":
        for name in ("instruction", "output"):
            if not isinstance(row[name], str) or not row[name].strip():
                return f"field '{name}' must be a non-empty string"
        for name in ("input", "system"):
            if row.get(name) is not None and not isinstance(row[name], str):
                return f"field '{name}' must be a string"
        return ""
    if fmt == "prompt_only":
        return _check_text_or_messages("prompt", row["prompt"], last_role="user")
    raise ValueError(f"unknown format {fmt!r}")


def normalise(fmt: str, row: dict[str, Any]) -> dict[str, Any]:
    """A valid row in its destination's canonical form (extra columns kept)."""
    if fmt == "messages":
        extra = {k: v for k, v in row.items() if k != "messages"}
        msgs = row["messages"]
        return {"prompt": msgs[:-1], "completion": msgs[-1:], **extra}
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
