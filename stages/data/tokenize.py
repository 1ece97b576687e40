"""Rendering rows with the chat template and tokenising them with a completion mask.

The completion mask comes from positions (where the prompt's tokens end, or the
template's `{% generation %}` spans for `assistant_only`), never from `ids != pad`: many
tokenizers use EOS as the pad token, and the real EOS must be learnt.
"""
from __future__ import annotations

from typing import Any, Callable

from stages.data.formats import is_messages
from stages.data.templates import apply_chat_template


def render(tokenizer, row: dict[str, Any], *, text_field: str = "text") -> tuple[str, str]:
    """(prompt text, completion text) of an SFT row; completion text ends with EOS."""
    if text_field in row and "completion" not in row:
        return "", _with_eos(tokenizer, row[text_field])
    prompt, completion = row["prompt"], row["completion"]
    if is_messages(prompt):
        require_chat_template(tokenizer)
        rendered = apply_chat_template({"prompt": prompt, "completion": completion}, tokenizer)
        return rendered["prompt"], rendered["completion"]
    return prompt, _with_eos(tokenizer, completion)


def require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the data is conversational (lists of messages) but the tokenizer "
                         f"({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; use an instruct/chat "
                         "model, or set tokenizer.chat_template and save it into the model folder, or convert the "
                         "data to plain prompt/completion strings")


def render_prompt(tokenizer, prompt: Any) -> str:
    if is_messages(prompt):
        require_chat_template(tokenizer)
        return apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
    return prompt


def _with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def tokenize_sft(tokenizer, rows: list[dict[str, Any]], *, max_length: int | None = None, text_field: str = "text",
                 formatting_func: Callable[[dict], str] | None = None, assistant_only: bool = False
                 ) -> list[dict[str, list[int]]]:
    """input_ids and completion_mask (1 where the loss applies) per row, truncated to max_length.

    formatting_func: row -> text, for rows in a shape of the user's own (loss on all tokens).
    assistant_only: conversations are rendered whole and every assistant turn is a target
    (the template's `{% generation %}` spans), not only the last one.
    """
    if formatting_func is not None:
        rows = [{text_field: formatting_func(r)} for r in rows]
    if assistant_only and rows and is_messages(rows[0].get("prompt")):
        out = [_assistant_tokens(tokenizer, r) for r in rows]
    else:
        rendered = [render(tokenizer, r, text_field=text_field) for r in rows]
        prompts = tokenizer([p for p, _ in rendered], add_special_tokens=False)["input_ids"]
        completions = tokenizer([c for _, c in rendered], add_special_tokens=False)["input_ids"]
        out = [{"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)}
               for p, c in zip(prompts, completions)]
    if max_length is not None:
        out = [{k: v[:max_length] for k, v in r.items()} for r in out]
    return out


def _assistant_tokens(tokenizer, row: dict[str, Any]) -> dict[str, list[int]]:
    require_chat_template(tokenizer)
    enc = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    mask = list(enc["assistant_masks"])
    if not any(mask):
        raise ValueError("sft.assistant_only_loss = true, but the chat template marks no assistant tokens: it needs "
                         "{% generation %}...{% endgeneration %} around assistant content; use such a template or "
                         "set sft.assistant_only_loss: false")
    return {"input_ids": list(enc["input_ids"]), "assistant_masks": mask}


def longest_token_chars(tokenizer) -> int:
    """The most characters one vocabulary token stands for (an upper bound for byte-level and SentencePiece
    vocabularies, whose token strings hold at least one character per character or byte they decode to)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def content_chars(value: Any) -> int:
    """Characters of the text in a prompt/completion value (a string or chat messages), template excluded."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(content_chars(m.get("content", "")) if isinstance(m, dict) else content_chars(m) for m in value)
    return 0
