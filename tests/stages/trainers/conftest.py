"""What the trainer tests share: a tiny built-in model and rows of the built-in task."""
from __future__ import annotations

import dataclasses

from stages.builtin import arithmetic, tiny
from stages.data.formats import normalise
from stages.harness.config import ArithmeticConfig


def build_tiny(folder, *, hidden_size: int = 32, num_layers: int = 1, num_heads: int = 2,
               intermediate_size: int = 64):
    """A built-in Llama (+ tokenizer) saved in `folder`; returns its path."""
    return tiny.build(folder, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      intermediate_size=intermediate_size, vocab_size=384, seed=0)


def builtin_rows(split: str, fmt: str, *, num_train: int = 10, num_preference: int = 64, num_eval: int = 10):
    """One split of `builtin:arithmetic`, normalised as format `fmt` (see stages.data.formats)."""
    cfg = ArithmeticConfig(num_train=num_train, num_preference=num_preference, num_eval=num_eval, num_dev=0)
    return [normalise(fmt, r) for r in arithmetic.generate(**dataclasses.asdict(cfg))[split]]
