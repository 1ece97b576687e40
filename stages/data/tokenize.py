"""Rendering rows with the chat template and tokenising them with a completion mask.

The completion mask comes from positions (where the prompt's tokens end), never from
`ids != pad`: many tokenizers use EOS as the pad token, and the real EOS must be learnt.
"""
from __future__ import annotations

from typing import Any

from stages.data.formats import is_conversational


def render(tokenizer, row: dict[str, Any]) -> tuple[str, str]:
    """(prompt text, completion text) of an SFT row; completion text ends with EOS."""
    if "text" in row:
        return "", _with_eos(tokenizer, row["text"])
    prompt, completion = row["prompt"], row["completion"]
    if is_conversational(prompt):
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full.startswith(prompt_text):
            raise ValueError("the chat template renders the prompt differently once the completion is appended "
                             f"(prompt: {prompt_text[-60:]!r}); use a template whose generation prompt is a prefix "
                             "of the full conversation")
        return prompt_text, full[len(prompt_text):]
    return prompt, _with_eos(tokenizer, completion)


def render_prompt(tokenizer, prompt: Any) -> str:
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def _with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def tokenize_sft(tokenizer, rows: list[dict[str, Any]], *, max_length: int | None = None) -> list[dict[str, list[int]]]:
    """input_ids and completion_mask (1 on completion tokens) per row, truncated to max_length."""
    rendered = [render(tokenizer, r) for r in rows]
    prompts = tokenizer([p for p, _ in rendered], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in rendered], add_special_tokens=False)["input_ids"]
    out = []
    for p, c in zip(prompts, completions):
        ids, mask = p + c, [0] * len(p) + [1] * len(c)
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        out.append({"input_ids": ids, "completion_mask": mask})
    return out
