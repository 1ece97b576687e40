"""Helpers the losses share: upcasting, shape checks, named-variant lookup, masked means."""
from __future__ import annotations

import torch


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are computed in float32; float32 and float64 are kept as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_shapes(expected: torch.Size, like: str, **tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming each tensor whose shape differs from `expected` (the shape of `like`)."""
    wrong = [f"{name} has shape {tuple(t.shape)}" for name, t in tensors.items()
             if t is not None and t.shape != expected]
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}: expected {tuple(expected)}, the shape of {like}")


def _pick(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(f"{what} = {name!r} is not supported; choose one of {sorted(table)}")
    return table[name]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1; 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)
