"""Generated token ids to the strings reward functions see, with the reasoning-block policy spelled out.

`parse_completions` splits each completion into its answer and reasoning (`Completion`);
`decode_and_strip_padding` keeps the answers; `answer_after_reasoning` does the same for a
string. A tokenizer is passed in by the caller (any `transformers` tokenizer works; nothing
here imports transformers).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from stages.tensors import completion_mask_from_eos, eos_ids

__all__ = ["THINK_TAGS", "Completion", "answer_after_reasoning", "clean_decoded_text", "decode_and_strip_padding",
           "parse_completions"]

THINK_TAGS = ("<think>", "</think>")  # the reasoning block's opening and closing tags


@dataclass(frozen=True)
class Completion:
    """One parsed completion.

    Attributes:
        answer: the text reward functions score ("" when no answer was produced).
        reasoning: the reasoning text, ``None`` when the completion has no reasoning block.
        finished: the model emitted EOS and left no reasoning block open.
    """

    answer: str
    reasoning: str | None
    finished: bool


_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def clean_decoded_text(text: str, *, replace_markers: bool = False) -> str:
    """Remove decoder artefacts and surrounding whitespace from one decoded string.

    - trailing U+FFFD replacement characters are dropped: they are what is left of a
      multi-byte character whose last bytes were cut off by the length limit (a U+FFFD
      in the middle of the text is kept, the model really produced invalid bytes there);
    - with ``replace_markers=True``, leaked tokenizer markers are turned back into the
      whitespace they encode: SentencePiece ``"▁"`` and byte-level ``"Ġ"`` to a space,
      byte-level ``"Ċ"`` to a newline. Off by default because ``"Ġ"`` is also a real
      letter (Maltese); :func:`parse_completions` turns it on only for tokenizers whose
      decoder is detected to leak markers.
    """
    if replace_markers:
        text = text.replace("▁", " ").replace("Ġ", " ").replace("Ċ", "\n")
    return text.strip().rstrip("\ufffd").strip()


def _marker_kind(tokenizer) -> str | None:
    """``"bytelevel"``/``"sentencepiece"`` if ``tokenizer.decode`` leaks raw markers, else None.

    A tokenizer whose ``tokenizer.json`` lacks a decoder returns raw tokens ("Ġhello",
    "cafÃ©"); detecting that once and decoding the tokens ourselves is more faithful than
    string replacements on the broken output.
    """
    probe = tokenizer.decode(tokenizer.encode(" a b\nc", add_special_tokens=False), skip_special_tokens=True)
    if "Ġ" in probe or "Ċ" in probe:
        return "bytelevel"
    if "▁" in probe:
        return "sentencepiece"
    return None


def _decode_tokens_manually(tokenizer, ids: list[int], kind: str, keep: set[int]) -> str:
    """Decode ids from raw token strings (fallback for tokenizers without a decoder)."""
    byte_dec = _byte_decoder()
    buf = bytearray()
    for tok_id, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if tok is None:
            continue
        if tok_id in keep:  # the think tags: literal text
            buf += tok.encode()
        elif kind == "bytelevel" and all(c in byte_dec for c in tok):
            buf += bytes(byte_dec[c] for c in tok)
        elif (m := _SP_BYTE.match(tok)) is not None:  # SentencePiece byte-fallback token
            buf.append(int(m.group(1), 16))
        else:
            buf += tok.replace("▁", " ").encode()
    return buf.decode("utf-8", errors="replace")


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    # Tokens added with `special=True` but not listed as named special tokens (chat
    # markers like <|im_start|> in some checkpoints) are special too.
    for tok_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tok_id))
    return ids


def _single_token_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _split_reasoning(text: str, open_tag: str, close_tag: str, thinking_in_prompt: bool):
    """Return ``(answer, reasoning, complete)`` following the policy in parse_completions."""
    last_close = text.rfind(close_tag)
    if last_close == -1:
        start = text.find(open_tag)
        if start == -1 and not thinking_in_prompt:
            return text, None, True  # no reasoning block at all
        # Opened (here or in the prompt) and never closed: no answer was produced.
        body = text if start == -1 else text[start + len(open_tag) :]
        return "", body, False
    tail = text[last_close + len(close_tag) :]
    reopened = tail.find(open_tag)
    head = text[:last_close]
    if reopened != -1:
        head, tail = text, ""  # a block opened after the last close and never closed
    parts = [p.strip() for p in re.split(f"{re.escape(open_tag)}|{re.escape(close_tag)}", head)]
    reasoning = "\n".join(clean_decoded_text(p) for p in parts if p)
    if reopened != -1:
        return "", reasoning, False
    return tail, reasoning, True


def answer_after_reasoning(text: str, think_tags: tuple[str, str] = THINK_TAGS) -> str:
    """The answer part of an already-decoded text, by the same policy as `parse_completions`."""
    return _split_reasoning(text, think_tags[0], think_tags[1], thinking_in_prompt=False)[0]


def parse_completions(
    token_ids: torch.Tensor | Sequence[Sequence[int]],
    tokenizer,
    *,
    mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    think_tags: tuple[str, str] | None = THINK_TAGS,
    thinking_in_prompt: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
) -> list[Completion]:
    """Turn generated completions into :class:`Completion` records (answer, reasoning, finished).

    Input: ``token_ids: (B, T)``, the generated tokens only (no prompt), right-padded
    with the tokenizer's pad id, which may equal the EOS id. Tokens after the first EOS
    are ignored, as are positions where ``mask`` (``(B, T)``, 1 = keep) is 0. The kept
    ids are decoded with every special token removed (pad, EOS, chat markers) *except*
    the think tags, which survive even when registered as special tokens (where
    ``skip_special_tokens=True`` would erase them and make the blocks undetectable).

    Completion shapes and the policy applied (``<think>``/``</think>`` = ``think_tags``):

    ==========================================  ============  ================  ========
    completion text                             answer        reasoning         finished
    ==========================================  ============  ================  ========
    ``answer<EOS>`` (no block)                  ``answer``    ``None``          True
    ``<think>r</think>answer<EOS>``             ``answer``    ``r``             True
    ``r</think>answer<EOS>`` (opened in prompt) ``answer``    ``r``             True
    ``<think>r...`` (never closed, length cut)  ``""``        ``r...``          False
    ``<think>a</think>x<think>b</think>answer`` ``answer``    ``a\\nx\\nb``     True
    ``<think>a</think>x<think>b...`` (reopened) ``""``        ``a\\nx\\nb...``  False
    ``answer`` with no EOS (length cut)         ``answer``    ``None``          False
    ==========================================  ============  ================  ========

    With several blocks the answer is the text after the *last* closing tag, and the
    reasoning is everything before it, tags removed, pieces joined by newlines. With
    ``thinking_in_prompt=True`` (the chat template ends the generation prompt with
    ``<think>``) a completion with no closing tag is an unclosed block, so its answer is
    "" rather than the raw reasoning. ``think_tags=None`` disables block parsing.

    Decoder artefacts are removed: surrounding whitespace, a trailing U+FFFD left by a
    multi-byte character cut in half, and (for tokenizers whose decoder leaks them)
    byte-level ``"Ġ"``/``"Ċ"`` and SentencePiece ``"▁"`` markers.

    ``finished`` is True iff an EOS (``eos_token_id``, default ``tokenizer.eos_token_id``;
    may be a list) was emitted within the kept tokens and no reasoning block is open.

    Raises:
        ValueError: ``token_ids`` not 2-D integer, ``mask`` of another shape, or a
            tokenizer without a pad id when ``mask`` is None.
    """
    ids = torch.as_tensor(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids
    if ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"`token_ids` must be a (B, T) integer tensor; got shape {tuple(ids.shape)}, "
                         f"dtype {ids.dtype}")
    ids = ids.detach().cpu().long()
    if mask is None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "`tokenizer` has no pad_token_id, so padding cannot be told apart from text; "
                "set tokenizer.pad_token or pass `mask` of shape (B, T)"
            )
        keep = torch.ones_like(ids, dtype=torch.bool)
    else:
        m = torch.as_tensor(mask) if not isinstance(mask, torch.Tensor) else mask
        if tuple(m.shape) != tuple(ids.shape):
            raise ValueError(f"`mask` must have the shape of token_ids {tuple(ids.shape)}; got {tuple(m.shape)}")
        keep = m.detach().cpu() != 0

    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is not None:
        eos_list = eos_ids(eos_token_id)
        within = completion_mask_from_eos(ids, eos_list).bool()
        keep &= within  # drop everything after the first EOS
        has_eos = (torch.isin(ids, torch.tensor(eos_list)) & keep).any(dim=1).tolist()
    else:
        has_eos = [False] * ids.shape[0]

    specials = _special_ids(tokenizer)
    think_ids: set[int] = set()
    if think_tags is not None:
        for tag in think_tags:
            tag_id = _single_token_id(tokenizer, tag)
            if tag_id is not None:
                think_ids.add(tag_id)
    drop = specials - think_ids
    rows = [[t for t, k in zip(r, kr, strict=True) if k and t not in drop]
            for r, kr in zip(ids.tolist(), keep.tolist(), strict=True)]

    kind = _marker_kind(tokenizer)
    if kind is None:
        texts = tokenizer.batch_decode(rows, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    else:
        texts = [_decode_tokens_manually(tokenizer, r, kind, think_ids) for r in rows]

    out = []
    for text, eos in zip(texts, has_eos, strict=True):
        if think_tags is None:
            answer, reasoning, complete = text, None, True
        else:
            answer, reasoning, complete = _split_reasoning(text, think_tags[0], think_tags[1], thinking_in_prompt)
        out.append(
            Completion(
                answer=clean_decoded_text(answer),
                reasoning=None if reasoning is None else clean_decoded_text(reasoning),
                finished=bool(eos) and complete,
            )
        )
    return out


def decode_and_strip_padding(
    token_ids: torch.Tensor | Sequence[Sequence[int]],
    tokenizer,
    *,
    mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    think_tags: tuple[str, str] | None = THINK_TAGS,
    thinking_in_prompt: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
) -> list[str]:
    """The strings reward functions receive: ``[c.answer for c in parse_completions(...)]``.

    ``token_ids: (B, T)`` generated completions, right-padded with the pad id (which may
    equal EOS). See :func:`parse_completions` for the full policy; in short: no reasoning
    block -> the decoded text; ``<think>...</think>answer`` or ``...</think>answer``
    (block opened by the prompt) -> ``answer``; several blocks -> the text after the last
    closing tag; a block that is never closed -> ``""``. Tokens after the first EOS are
    ignored, think tags survive decoding even as special tokens, other special tokens are
    removed, and surrounding whitespace, a trailing cut multi-byte character and leaked
    tokenizer markers are cleaned up.
    """
    return [
        c.answer
        for c in parse_completions(
            token_ids,
            tokenizer,
            mask=mask,
            think_tags=think_tags,
            thinking_in_prompt=thinking_in_prompt,
            eos_token_id=eos_token_id,
        )
    ]
