"""Tensor and text plumbing shared by the alignment stages.

- :func:`pad`, :func:`pad_to_length`, :func:`flush_left`: batch shaping for
  variable-length sequences (``pad`` and ``pad_to_length`` with TRL's signatures);
- :func:`selective_log_softmax` (from :mod:`stages.kernels`): ``log_softmax(logits)`` read at
  ``index``, TRL's ``selective_log_softmax(logits, index)``;
- :func:`completion_mask_from_eos`: which generated tokens belong to the completion;
- :func:`parse_completions` / :func:`decode_and_strip_padding`: generated token ids to
  the strings reward functions see, with the reasoning-block policy spelled out below.

Only torch is imported at module level; a tokenizer is passed in by the caller
(any ``transformers`` tokenizer works; nothing here imports transformers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
import re

import torch

from stages.kernels import selective_log_softmax

__all__ = [
    "Completion",
    "clean_decoded_text",
    "completion_mask_from_eos",
    "decode_and_strip_padding",
    "flush_left",
    "pad",
    "pad_to_length",
    "parse_completions",
    "selective_log_softmax",
]


# ------------------------------------------------------------------------ tensors


def pad(
    tensors: Sequence[torch.Tensor],
    padding_value: float | int | bool = 0,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.Tensor:
    """Stack tensors of different sizes into one padded tensor.

    Args:
        tensors: B tensors with the same ndim, dtype and device; shapes may differ in
            any dim (typically only the first, the sequence length ``L_i``).
        padding_value: fill value for the padded positions.
        padding_side: ``"right"`` keeps each tensor at the start of every dim,
            ``"left"`` aligns it to the end (prompts for generation are left-padded).
        pad_to_multiple_of: round the first (sequence) dim of the output up to a
            multiple of this (tensor cores / fixed compile shapes like multiples of 8).

    Returns:
        ``(B, max L_i, *max rest)`` tensor.

    Example: ``pad([tensor([1, 2, 3]), tensor([4])], 0, "left") == tensor([[1, 2, 3], [0, 0, 4]])``.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right'; got {padding_side!r}")
    if len(tensors) == 0:
        raise ValueError("`tensors` must be a non-empty sequence of tensors")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`tensors[{i}]` must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != first.dim() or t.dim() == 0:
            raise ValueError(
                f"`tensors` must all have the same ndim >= 1 (shape (L_i, ...)); "
                f"tensors[0] has shape {tuple(first.shape)}, tensors[{i}] has shape {tuple(t.shape)}"
            )
        if t.dtype != first.dtype:
            raise ValueError(f"`tensors` must share one dtype; got {first.dtype} and {t.dtype} (tensors[{i}])")
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise ValueError(f"`pad_to_multiple_of` must be a positive int; got {pad_to_multiple_of}")

    shape = [max(t.shape[d] for t in tensors) for d in range(first.dim())]
    if pad_to_multiple_of:
        shape[0] = -(-shape[0] // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(tensors), *shape), padding_value, dtype=first.dtype, device=first.device)
    for i, t in enumerate(tensors):
        if padding_side == "right":
            region = tuple(slice(0, s) for s in t.shape)
        else:
            region = tuple(slice(m - s, m) for s, m in zip(t.shape, shape))
        out[(i, *region)] = t
    return out


def pad_to_length(
    tensor: torch.Tensor,
    length: int,
    pad_value: float | int | bool = 0,
    dim: int = -1,
    padding_side: str = "right",
) -> torch.Tensor:
    """Pad ``tensor`` along ``dim`` with ``pad_value`` up to ``length`` (TRL's signature and semantics).

    A tensor already ``length`` long or longer is returned as it is (never truncated, as
    in TRL). ``padding_side="left"`` (not in TRL) pads at the start instead of the end.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right'; got {padding_side!r}")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"`dim` must index a dim of `tensor` with shape {tuple(tensor.shape)}; got {dim}")
    size = tensor.shape[dim]
    if size >= length:
        return tensor
    fill_shape = list(tensor.shape)
    fill_shape[dim] = length - size
    fill = torch.full(fill_shape, pad_value, dtype=tensor.dtype, device=tensor.device)
    parts = (tensor, fill) if padding_side == "right" else (fill, tensor)
    return torch.cat(parts, dim=dim)


def flush_left(mask: torch.Tensor, *tensors: torch.Tensor):
    """Shift every row left so its first 1 lands in column 0, then drop empty trailing columns.

    Turns left-padded prompt+completion batches into right-padded ones without changing
    the order of tokens inside a row. Each row is rotated (``torch.roll``-style), so the
    leading zeros of a row wrap around to its end; the same rotation is applied to every
    tensor. Afterwards the columns to the right of the last column holding any 1 are cut.

    Args:
        mask: ``(B, T)`` 0/1 (or bool) mask.
        *tensors: ``(B, T, ...)`` tensors moved with the mask (input ids, log-probs...).

    Returns:
        the new ``(B, T')`` mask if no tensors are given, else ``(mask, *tensors)``.

    Example: ``mask=[[0, 0, 1, 1], [0, 1, 1, 1]]`` becomes ``[[1, 1, 0], [1, 1, 1]]``.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"`mask` must be a (B, T) tensor; got {got}")
    bsz, width = mask.shape
    for i, t in enumerate(tensors):
        if t.dim() < 2 or tuple(t.shape[:2]) != (bsz, width):
            raise ValueError(f"`tensors[{i}]` must have shape ({bsz}, {width}, ...) like mask; got {tuple(t.shape)}")
    nonzero = mask != 0
    # argmax over a 0/1 int row returns the first 1 (0 for all-zero rows: no shift).
    shift = nonzero.int().argmax(dim=1)
    cols = (torch.arange(width, device=mask.device)[None, :] + shift[:, None]) % width  # (B, T)
    new_mask = mask.gather(1, cols)
    kept = (new_mask != 0).any(dim=0)
    new_width = int(kept.nonzero().max()) + 1 if bool(kept.any()) else 0
    new_mask = new_mask[:, :new_width]
    moved = []
    for t in tensors:
        idx = cols.view(bsz, width, *([1] * (t.dim() - 2))).expand_as(t)
        moved.append(t.gather(1, idx)[:, :new_width])
    return new_mask if not moved else (new_mask, *moved)


def _eos_ids(eos_token_id: int | Sequence[int], name: str = "eos_token_id") -> list[int]:
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"`{name}` must be an int or a non-empty sequence of ints; got {eos_token_id!r}")
    return ids


def completion_mask_from_eos(
    completion_ids: torch.Tensor,
    eos_token_id: int | Sequence[int],
) -> torch.Tensor:
    """1 for every token up to and including the first EOS of each row, 0 after it.

    The mask is built from the *position* of the first EOS (rows without one are all
    1), never from ``completion_ids != pad_token_id``: many tokenizers use the EOS id as
    the pad id, and that comparison would mask out the EOS the model actually emitted.

    Args:
        completion_ids: ``(B, T)`` generated token ids, right-padded.
        eos_token_id: one id or several (generation configs often list several stop ids).

    Returns:
        ``(B, T)`` torch.long mask.
    """
    if not isinstance(completion_ids, torch.Tensor) or completion_ids.dim() != 2:
        got = tuple(completion_ids.shape) if isinstance(completion_ids, torch.Tensor) else type(completion_ids).__name__
        raise ValueError(f"`completion_ids` must be a (B, T) integer tensor; got {got}")
    if completion_ids.is_floating_point():
        raise ValueError(f"`completion_ids` must be an integer tensor; got dtype {completion_ids.dtype}")
    eos = torch.tensor(_eos_ids(eos_token_id), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos)
    bsz, width = completion_ids.shape
    first = torch.full((bsz,), width, dtype=torch.long, device=completion_ids.device)
    has = is_eos.any(dim=1)
    first[has] = is_eos.int().argmax(dim=1)[has]
    return (torch.arange(width, device=completion_ids.device)[None, :] <= first[:, None]).long()


# --------------------------------------------------------------------------- text


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
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
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
    for tok_id, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
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


def answer_after_reasoning(text: str, think_tags: tuple[str, str] = ("<think>", "</think>")) -> str:
    """The answer part of an already-decoded text, by the same policy as `parse_completions`."""
    return _split_reasoning(text, think_tags[0], think_tags[1], thinking_in_prompt=False)[0]


def parse_completions(
    token_ids: torch.Tensor | Sequence[Sequence[int]],
    tokenizer,
    *,
    mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    think_tags: tuple[str, str] | None = ("<think>", "</think>"),
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
        raise ValueError(f"`token_ids` must be a (B, T) integer tensor; got shape {tuple(ids.shape)}, dtype {ids.dtype}")
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
        eos_list = _eos_ids(eos_token_id)
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
    rows = [[t for t, k in zip(r, kr) if k and t not in drop] for r, kr in zip(ids.tolist(), keep.tolist())]

    kind = _marker_kind(tokenizer)
    if kind is None:
        texts = tokenizer.batch_decode(rows, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    else:
        texts = [_decode_tokens_manually(tokenizer, r, kind, think_ids) for r in rows]

    out = []
    for text, eos in zip(texts, has_eos):
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
    think_tags: tuple[str, str] | None = ("<think>", "</think>"),
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
