"""`builtin:arithmetic`: a verifiable task with systematically imperfect demonstrations.

Prompts are additions of two `digits`-digit numbers ("47+85"); the right answer is
checkable exactly. Demonstrations come from imperfect "labellers" who drop the carry in a
fraction `error_rate` of the sums that need one (47+85 -> 122 instead of 132). Random
errors spread over many values would leave the right answer the most likely one; a
systematic error is what SFT faithfully learns and what the later alignment stages
(preferences, rewards) can fix.

Everything is generated deterministically from `seed`. Splits, all conversational:
  sft        {"messages": [user, assistant]}                  demonstrations (some wrong)
  preference {"prompt": [user], "chosen": [assistant], "rejected": [assistant]}
  unpaired   {"prompt": [user], "completion": [assistant], "label": bool}
  prompts    {"prompt": [user], "answer": str}                 prompt-only (for RL / scoring)
  eval       {"prompt": [user], "completion": [assistant]}     held out, correct references
  dev        same as eval, other prompts                       held out for model selection (tuning)
With `reasoning`, assistant answers carry a `<think>` block with the column sums. With `tools`,
demonstrations call a calculator and every row carries its schema (`stages.builtin.arithmetic_tools`).
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from stages.builtin import arithmetic_tools

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def columns(a: int, b: int) -> list[tuple[int, int]]:
    """Digit pairs from the units column up."""
    out = []
    while a or b:
        out.append((a % 10, b % 10))
        a, b = a // 10, b // 10
    return out or [(0, 0)]


def needs_carry(a: int, b: int) -> bool:
    """True if dropping the carry changes the result (a carry out of a non-top column)."""
    cols = columns(a, b)
    return any(x + y >= 10 for x, y in cols[:-1])


def add(a: int, b: int, *, drop_carry: bool = False) -> tuple[int, str]:
    """(sum, reasoning): column addition; with `drop_carry` the carries are forgotten."""
    cols, carry, digits, steps = columns(a, b), 0, [], []
    for i, (x, y) in enumerate(cols):
        s = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        if i == len(cols) - 1:
            digits.append(str(s)[::-1])
        else:
            digits.append(str(s % 10))
            carry = 0 if drop_carry else s // 10
    return int("".join(digits)[::-1]), ", ".join(steps)


def answer_text(value: int, reasoning: str | None) -> str:
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{value}" if reasoning is not None else str(value)


PROMPT = "{a}+{b}"


def _user(a: int, b: int, prompt: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt.format(a=a, b=b)}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _pairs(rng: random.Random, digits: int) -> list[tuple[int, int]]:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    if (hi - lo + 1) ** 2 <= 200_000:  # enumerate small spaces so splits are disjoint and duplicate-free
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        rng.shuffle(pairs)
        return pairs
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(200_000)]


def _wrong(rng: random.Random, a: int, b: int) -> tuple[int, str]:
    if needs_carry(a, b):
        return add(a, b, drop_carry=True)
    right, steps = add(a, b)
    return right + rng.choice([-10, -1, 1, 10]), steps


def generate(*, num_train: int, num_preference: int, num_eval: int, digits: int, error_rate: float,
             reasoning: bool, seed: int, num_dev: int = 0, prompt: str = PROMPT,
             tools: bool = False) -> dict[str, list[dict[str, Any]]]:
    """All splits of the task. Eval and dev prompts never appear in any training split, nor in each other.

    The eval prompts are the first `num_eval` of the shuffled sums whatever `num_dev` is (the dev
    prompts come next), so adding a dev split leaves the eval split as it was.
    """
    rng = random.Random(seed)
    pairs = _pairs(rng, digits)
    if len(pairs) <= num_eval + num_dev:
        raise ValueError(f"data.builtin.num_eval + num_dev = {num_eval} + {num_dev}: only {len(pairs)} distinct "
                         f"{digits}-digit sums exist; lower num_eval or num_dev, or raise digits")
    eval_pairs, dev_pairs = pairs[:num_eval], pairs[num_eval:num_eval + num_dev]
    train_pairs = pairs[num_eval + num_dev:]

    def text(value: int, steps: str) -> str:
        return answer_text(value, steps if reasoning else None)

    def right(a: int, b: int) -> list[dict[str, Any]]:
        """The correct assistant turns: the tool's episode, or the answer by hand."""
        if tools:
            return arithmetic_tools.with_tool([], a, b, str(a + b))
        return _assistant(text(*add(a, b)))

    def row(**columns: Any) -> dict[str, Any]:
        return {**columns, "tools": [arithmetic_tools.ADD_SCHEMA]} if tools else columns

    sft = []
    for i in range(num_train):
        a, b = train_pairs[i % len(train_pairs)]
        if i and i % len(train_pairs) == 0:
            rng.shuffle(train_pairs)
        wrong = needs_carry(a, b) and rng.random() < error_rate
        turns = _assistant(text(*add(a, b, drop_carry=True))) if wrong else right(a, b)
        sft.append(row(messages=_user(a, b, prompt) + turns))

    preference, unpaired, prompts = [], [], []
    for i in range(num_preference):
        a, b = train_pairs[rng.randrange(len(train_pairs))]
        good, bad = right(a, b), _assistant(text(*_wrong(rng, a, b)))
        preference.append(row(prompt=_user(a, b, prompt), chosen=good, rejected=bad))
        unpaired.append(row(prompt=_user(a, b, prompt), completion=good if i % 2 == 0 else bad, label=i % 2 == 0))
        prompts.append(row(prompt=_user(a, b, prompt), answer=str(a + b)))

    def held_out(pairs_: list[tuple[int, int]]) -> list[dict[str, Any]]:
        return [row(prompt=_user(a, b, prompt), completion=right(a, b)) for a, b in pairs_]

    return {"sft": sft, "preference": preference, "unpaired": unpaired, "prompts": prompts,
            "eval": held_out(eval_pairs), "dev": held_out(dev_pairs)}


def corpus(n: int = 3000, seed: int = 1234) -> Iterator[str]:
    """Raw strings the built-in tokenizer is trained on: the task's prompts and answers, both variants."""
    rng = random.Random(seed)
    for _ in range(n):
        digits = rng.randint(1, 4)
        a, b = rng.randint(0, 10**digits - 1), rng.randint(0, 10**digits - 1)
        value, steps = add(a, b)
        yield f"{a}+{b}"
        yield answer_text(value, steps)
    yield "The quick brown fox jumps over the lazy dog. Compute the sum of two numbers and answer."
