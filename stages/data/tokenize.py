"""Rendering rows with the chat template and tokenising them with a completion mask.

The completion mask comes from positions (where the prompt's tokens end, or the
template's `{% generation %}` spans for `assistant_only`), never from `ids != pad`: many
tokenizers use EOS as the pad token, and the real EOS must be learnt.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.data.formats import is_messages
from stages.data.templates import apply_chat_template, assistant_spans, has_generation_markers
from stages.data.tool_calls import parsed_messages, tool_schemas


def render(tokenizer, row: dict[str, Any], *, text_field: str = "text") -> tuple[str, str]:
    """(prompt text, completion text) of an SFT row; a completion given as text ends with EOS.

    Rows: `text_field` (plain text, all of it the completion), `messages` (a conversation rendered
    whole with the chat template, all of it the completion, as TRL's language-modelling rows), or
    prompt/completion (strings or message lists). A `tools` column goes to the template with the row."""
    if text_field in row and "completion" not in row:
        return "", _with_eos(tokenizer, row[text_field])
    if "messages" in row and "completion" not in row:
        require_chat_template(tokenizer)
        return "", apply_chat_template({"messages": row["messages"]}, tokenizer, row.get("tools"))["text"]
    if "prompt" not in row or "completion" not in row:
        raise ValueError(f"an SFT row has columns {sorted(row)}; expected 'messages' (a conversation), "
                         f"'prompt' and 'completion', or {text_field!r} (plain text; SFTConfig.dataset_text_field), "
                         "or pass formatting_func=row -> text")
    prompt, completion = row["prompt"], row["completion"]
    if is_messages(prompt):
        require_chat_template(tokenizer)
        rendered = apply_chat_template({"prompt": prompt, "completion": completion}, tokenizer, row.get("tools"))
        return rendered["prompt"], rendered["completion"]
    return prompt, _with_eos(tokenizer, completion)


def require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the data is conversational (lists of messages) but the tokenizer "
                         f"({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; use an instruct/chat "
                         "model, or set tokenizer.chat_template and save it into the model folder, or convert the "
                         "data to plain prompt/completion strings")


def render_prompt(tokenizer, prompt: Any, tools: Any = None) -> str:
    """A prompt as the model is given it: a conversation rendered with the chat template (with `tools`, its row's
    `tools` column, shown), a string as it is."""
    if is_messages(prompt):
        require_chat_template(tokenizer)
        return apply_chat_template({"prompt": prompt}, tokenizer, tools)["prompt"]
    return prompt


def _with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def tokenize_sft(tokenizer, rows: list[dict[str, Any]], *, max_length: int | None = None, text_field: str = "text",
                 formatting_func: Callable[[dict], str] | None = None, assistant_only: bool = False
                 ) -> list[dict[str, list[int]]]:
    """input_ids and completion_mask (1 where the loss applies) per row, truncated to max_length.

    formatting_func: row -> text, for rows in a shape of the user's own (loss on all tokens).
    assistant_only: conversations (`messages`, or prompt/completion message lists) are rendered
    whole with an `assistant_masks` column, 1 on every assistant turn: from the template's
    `{% generation %}` spans when it has them, else from `stages.data.templates.assistant_spans`
    (any template whose turns render as prefixes); tool results, like system and user turns, are not
    assistant turns, so they carry no loss. Their `completion_mask` is 1 from the end of
    the rendered prompt on (all 1 for `messages` rows), so with both masks applied, as TRL's
    collator does under completion_only_loss, a prompt/completion row trains the assistant turns
    of its completion only.
    """
    if formatting_func is not None:
        rows = [{text_field: formatting_func(r)} for r in rows]
    if assistant_only:
        out = [_assistant_tokens(tokenizer, *_conversation(r, i)) for i, r in enumerate(rows)]
    else:
        rendered = [render(tokenizer, r, text_field=text_field) for r in rows]
        prompts = tokenizer([p for p, _ in rendered], add_special_tokens=False)["input_ids"]
        completions = tokenizer([c for _, c in rendered], add_special_tokens=False)["input_ids"]
        out = [{"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)}
               for p, c in zip(prompts, completions, strict=True)]
    if max_length is not None:
        out = [{k: v[:max_length] for k, v in r.items()} for r in out]
    return out


def _conversation(row: dict[str, Any], index: int) -> tuple[list[dict], list[dict] | None, Any]:
    """(the whole conversation, its prompt or None, its tools) of a conversational SFT row (for assistant-only
    masks)."""
    if is_messages(row.get("messages")) and "completion" not in row:
        return row["messages"], None, row.get("tools")
    if is_messages(row.get("prompt")) and is_messages(row.get("completion")):
        return row["prompt"] + row["completion"], row["prompt"], row.get("tools")
    raise ValueError(f"sft.assistant_only_loss = true, but row {index} (columns {sorted(row)}) is not a "
                     "conversation: it needs 'messages', or 'prompt' and 'completion' as lists of chat messages; "
                     "set assistant_only_loss: false for plain-text rows (completion_only_loss masks the prompt)")


def _assistant_tokens(tokenizer, messages: list[dict], prompt: list[dict] | None, tools: Any
                      ) -> dict[str, list[int]]:
    require_chat_template(tokenizer)
    marked = has_generation_markers(tokenizer.chat_template)
    text, spans = ((apply_chat_template({"messages": messages}, tokenizer, tools)["text"], []) if marked
                   else assistant_spans(messages, tokenizer, tools))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = list(enc["input_ids"]), [start for start, _ in enc["offset_mapping"]]
    if marked:  # transformers' masks from the {% generation %} spans, on the same tokens
        mask = list(tokenizer.apply_chat_template(parsed_messages(messages), tools=tool_schemas(tools), tokenize=True,
                                                  return_dict=True, return_assistant_tokens_mask=True
                                                  )["assistant_masks"])
        if len(mask) != len(ids):
            raise ValueError(f"the chat template's assistant mask has {len(mask)} entries for the {len(ids)} tokens of "
                             "its rendered text; the tokenizer does not tokenise its own rendering consistently")
    else:
        mask = [int(any(s <= start < e for s, e in spans)) for start in starts]
    boundary = len(apply_chat_template({"prompt": prompt, "completion": messages[len(prompt):]}, tokenizer, tools
                                       )["prompt"]) if prompt is not None else 0
    completion = [int(start >= boundary) for start in starts]
    if not any(mask):
        raise ValueError("sft.assistant_only_loss = true, but the chat template marks no assistant tokens: its "
                         "{% generation %}...{% endgeneration %} spans are empty, or the conversation has no "
                         "assistant turn; fix the template or the rows, or set sft.assistant_only_loss: false")
    return {"input_ids": ids, "assistant_masks": mask, "completion_mask": completion}


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


# ------------------------------------------------------------------ tokenising a whole dataset with `datasets`

ROW_JSON = "row_json"  # the one column rows given as Python dicts travel in: JSON keeps each row exactly as given
CODE_FOLDERS = ("data", "trainers")  # the stages/ sub-packages whose code decides the tokens (the cache key hashes it)


def tokenized_dataset(rows, tokenize: Callable[..., list[dict]], *, marker: str, tokenizer,
                      num_proc: int | None = None, batch_size: int = 1000):
    """`rows` through `tokenize` as `Dataset.map(batched=True, num_proc=num_proc)`, cached as Arrow files.

    rows: a list (or iterable) of dicts (a Python function among a row's tools is stored as its JSON schema), a
    `datasets.Dataset`, or a `datasets.IterableDataset` (mapped lazily,
    uncached, for streaming); None stays None. Rows that already have the column `marker` (tokenised beforehand)
    are returned as a Dataset, untouched.
    tokenize(rows, start=i): row dicts -> tokenised row dicts (the same keys in every row); `start` is the index
    of the batch's first row, for messages that name a row.

    The cache key hashes the rows' content, the tokenizer's content (vocabulary, merges, normaliser, special
    tokens, chat template: `tokenizer_fingerprint`), the `tokenize` function with what it closes over (max
    length, ...) and the code under stages/data and stages/trainers: a cache file is reused only for the same
    tokens, never because a path or a config name matched. With `datasets.disable_caching()` nothing is written.
    """
    import datasets

    if rows is None:
        return None
    if isinstance(rows, datasets.IterableDataset):
        columns = rows.column_names or list(next(iter(rows)).keys())
        return rows.map(_TokenizeBatch(tokenize, _rows), batched=True, with_indices=True, batch_size=batch_size,
                        remove_columns=columns)
    if isinstance(rows, datasets.Dataset):
        if marker in rows.column_names:
            return rows
        source, decode, content = rows, _rows, ["dataset", rows._fingerprint, _cache_file_stats(rows)]
    else:
        rows = rows if isinstance(rows, list) else list(rows)
        if not rows or marker in rows[0]:
            return datasets.Dataset.from_list(rows)
        texts = [json.dumps(r, ensure_ascii=False, default=_function_schema) for r in rows]
        digest = hashlib.sha256()
        for text in texts:
            digest.update(text.encode() + b"\n")
        source, decode = datasets.Dataset.from_dict({ROW_JSON: texts}), _decode_json
        content = ["rows", digest.hexdigest()]
        del texts
    if len(source) == 0:
        return datasets.Dataset.from_list([])
    key = _hash([content, tokenizer_fingerprint(tokenizer), _function_hash(tokenize), _code_hash(), batch_size])
    kwargs: dict[str, Any] = {}
    if datasets.is_caching_enabled():
        folder = Path(datasets.config.HF_DATASETS_CACHE) / "align-tokenized"
        folder.mkdir(parents=True, exist_ok=True)
        kwargs["cache_file_name"] = str(folder / f"{key}.arrow")
    return source.map(_TokenizeBatch(tokenize, decode), batched=True, with_indices=True, batch_size=batch_size,
                      num_proc=num_proc if num_proc and num_proc > 1 else None, remove_columns=source.column_names,
                      new_fingerprint=key, load_from_cache_file=True, desc="tokenising", **kwargs)


class _TokenizeBatch:
    """The map function: a batch of columns -> rows -> `tokenize` -> columns (a class: it pickles to workers)."""

    def __init__(self, tokenize, decode):
        self.tokenize, self.decode = tokenize, decode

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return _columns(self.tokenize(self.decode(batch), start=indices[0] if indices else 0))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides a tokenizer's tokens: its vocabulary, merges, normaliser and pre-tokeniser (the
    backend's JSON), added and special tokens, the chat template and the padding/truncation sides."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "added": sorted((int(i), str(t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "sides": [getattr(tokenizer, "padding_side", None), getattr(tokenizer, "truncation_side", None)],
    }
    return _hash(parts)


def _function_hash(fn) -> str:
    """The tokenize function with its closure (max length, flags); a random key when it cannot be hashed (never
    reused, so never wrong)."""
    from datasets.fingerprint import Hasher

    try:
        return Hasher.hash(fn)
    except Exception:
        import uuid

        return uuid.uuid4().hex


@functools.lru_cache(maxsize=1)
def _code_hash_of(root: str, stats: tuple) -> str:
    h = hashlib.sha256()
    for rel, _, _ in stats:
        h.update(rel.encode() + b"\0" + (Path(root) / rel).read_bytes())
    return h.hexdigest()


def _code_hash() -> str:
    root = Path(__file__).resolve().parent.parent
    files = sorted(p for folder in CODE_FOLDERS for p in (root / folder).glob("*.py"))
    return _code_hash_of(str(root), tuple((p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                                          for p in files))


def _cache_file_stats(ds) -> list:
    """(file, size, mtime) of the Arrow files behind a Dataset: its fingerprint alone may be keyed by a path."""
    out = []
    for entry in ds.cache_files:
        p = Path(entry["filename"])
        out.append([str(p), *((p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else ())])
    return out


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _function_schema(value: Any) -> dict:
    """A Python function in a row (a tool of its `tools` column, in the Python API) as its JSON schema."""
    if callable(value):
        return tool_schemas([value])[0]  # type: ignore[index]
    raise TypeError(f"a row holds a {type(value).__name__}, which is not JSON; rows hold JSON values (and Python "
                    "functions as tools)")


def _decode_json(batch: dict[str, list]) -> list[dict[str, Any]]:
    return [json.loads(text) for text in batch[ROW_JSON]]


def _rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(batch)
    return [dict(zip(keys, values, strict=True)) for values in zip(*(batch[k] for k in keys), strict=True)]


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
