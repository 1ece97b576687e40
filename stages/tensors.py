"""Batch shaping for variable-length sequences, with TRL's signatures.

- `pad`, `pad_to_length`, `flush_left`: right/left padding and moving padding to one side;
- `selective_log_softmax` (from `stages.kernels`): `log_softmax(logits)` read at `index`;
- `completion_mask_from_eos`: which generated tokens belong to the completion.

Only torch is imported.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.kernels import selective_log_softmax

__all__ = ["completion_mask_from_eos", "eos_ids", "flush_left", "pad", "pad_to_length", "selective_log_softmax"]


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
        region: tuple[slice, ...]
        if padding_side == "right":
            region = tuple(slice(0, s) for s in t.shape)
        else:
            region = tuple(slice(m - s, m) for s, m in zip(t.shape, shape, strict=True))
        index: tuple[int | slice, ...] = (i, *region)
        out[index] = t
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


def eos_ids(eos_token_id: int | Sequence[int], name: str = "eos_token_id") -> list[int]:
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
    eos = torch.tensor(eos_ids(eos_token_id), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos)
    bsz, width = completion_ids.shape
    first = torch.full((bsz,), width, dtype=torch.long, device=completion_ids.device)
    has = is_eos.any(dim=1)
    first[has] = is_eos.int().argmax(dim=1)[has]
    return (torch.arange(width, device=completion_ids.device)[None, :] <= first[:, None]).long()
