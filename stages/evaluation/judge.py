"""A pairwise judge that is not the reward model the policy was trained against.

The judge is an OpenAI-compatible endpoint (`evaluate.judge.base_url` and `model`, the key read from the
environment variable *named* by `api_key_env`) or a local model folder (`model_path`). For each prompt it
sees a model's completion and the baseline's (SFT by default) twice, in both orders, so a judge that
favours the first (or second) answer cancels out; a tie counts one half. A reply that names no verdict is
not a tie: the pair it belongs to is left out of the rates (they are over the pairs read in both orders),
and `judge.unparsed` counts such replies. `judge.consistent` is the share of read pairs whose two orders
agree; a judge that only reads positions (always "1") scores 0 there and 1/2 on every pair.

Reported per model, each with a two-sided interval at `confidence`:
- `win_rate`: the mean over prompts of the two orders' mean verdict (normal interval of that mean);
- `lc_win_rate`: AlpacaEval 2's length-controlled win rate. A logistic regression of the per-prompt
  verdict on tanh(length difference / its standard deviation) separates the part of the preference that
  length explains; the win rate predicted at a length difference of 0 is sigmoid(intercept). Its interval
  is the percentile bootstrap over prompts (seeded, so reruns agree).

The judge's prompt is a text file with `{instruction}`, `{output_1}` and `{output_2}` (the shipped one:
`stages/evaluation/prompts/pairwise.txt`); the reply is read as 1, 2 or tie (`parse_verdict`).
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from stages.openai_client import OpenAIClient

CODE_FILES = ("prompts/pairwise.txt",)  # part of the evaluate stage's code: editing it makes the stage stale
DEFAULT_PROMPT = Path(__file__).resolve().parent / CODE_FILES[0]
FIELDS = ("{instruction}", "{output_1}", "{output_2}")
Ask = Callable[[list[str]], list[str]]  # judge prompts -> the judge's replies, in order


class JudgeError(RuntimeError):
    pass


# --------------------------------------------------------------------------- verdicts (pure)


def read_template(path: str | Path | None) -> str:
    text = Path(path or DEFAULT_PROMPT).read_text()
    missing = [f for f in FIELDS if f not in text]
    if missing:
        raise JudgeError(f"evaluate.judge.prompt_file = {path}: the prompt lacks {missing}; it must hold "
                         f"{', '.join(FIELDS)} (see {DEFAULT_PROMPT})")
    return text


def render(template: str, instruction: str, first: str, second: str) -> str:
    """The template with its fields replaced (str.replace: the texts may hold braces)."""
    return template.replace("{instruction}", instruction).replace("{output_1}", first).replace("{output_2}", second)


# the reply begins with its verdict: "1", "**2**", "Tie.", "1. 25+60 = 85" (not "1+1=2" or "1.5": the task's sums)
LEADING = re.compile(r"^\W*(1|2|tie)\b(?![.,]\d)(?!\s*[-+*/=]\s*\d)")
NAMED = re.compile(r"\b(?:answer|output)\s*#?\s*(1|2)\b|\b(tie)\b")  # "... answer 1 is better", "a tie"
DIGITS = re.compile(r"\b([12])\b(?![.,]\d)")
NUMBERS = re.compile(r"\d+(?:[.,]\d+)?")


def parse_verdict(reply: str) -> str | None:
    """"1", "2", "tie", or None when the reply names no verdict, or several. Read, in turn: a reply beginning
    with the verdict; one naming exactly one of "answer 1", "answer 2" and "tie" (and no other 1 or 2: "answer 1
    or 2" is not read); one whose only number is 1 or 2 ("The better answer is 1"). Any other number is no
    verdict (a judge that solves "7+8" replies "15")."""
    text = reply.strip().lower()
    m = LEADING.match(text)
    if m:
        return m.group(1)
    named = {a or b for a, b in NAMED.findall(text)}
    if named:
        return named.pop() if len(named) == 1 and set(DIGITS.findall(text)) <= named else None
    numbers = NUMBERS.findall(text)
    return numbers[0] if len(numbers) == 1 and numbers[0] in ("1", "2") else None


def pair_score(forward: str | None, reverse: str | None) -> float | None:
    """The model's score on one prompt: forward shows (model, baseline), reverse (baseline, model).
    Each order gives 1 (model better), 0 (baseline better) or 1/2 (tie); the score is their mean.
    None when either reply was not read: one order alone keeps the judge's position bias."""
    if forward is None or reverse is None:
        return None
    f = {"1": 1.0, "2": 0.0}.get(forward, 0.5)
    r = {"2": 1.0, "1": 0.0}.get(reverse, 0.5)
    return (f + r) / 2


def consistent(forward: str, reverse: str) -> bool:
    """Both orders point at the same answer (or both call it a tie)."""
    return {"1": "2", "2": "1", "tie": "tie"}[forward] == reverse


def two_sided_z(confidence: float) -> float:
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def win_rate(scores: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): the normal interval mean ± z·sd/√n of the per-prompt scores, clipped to [0, 1]."""
    y = np.asarray(scores, dtype=float)
    mean = float(y.mean())
    half = two_sided_z(confidence) * float(y.std(ddof=1)) / math.sqrt(len(y)) if len(y) > 1 else 0.0
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def fit_length_logistic(y: np.ndarray, x: np.ndarray, *, penalty: float = 1e-3, iterations: int = 100
                        ) -> tuple[float, float]:
    """(intercept, slope) of P = sigmoid(a + b·x) fitted to soft targets y in [0, 1] by Newton's method on the
    cross-entropy plus penalty/2·(a² + b²) (which keeps both finite when y is all 0s or 1s)."""
    theta = np.zeros(2)
    design = np.stack([np.ones_like(x), x], axis=1)
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-(design @ theta)))
        grad = design.T @ (y - p) - penalty * theta
        hess = (design * (p * (1 - p))[:, None]).T @ design + penalty * np.eye(2)
        step = np.linalg.solve(hess, grad)
        theta += step
        if np.abs(step).max() < 1e-10:
            break
    return float(theta[0]), float(theta[1])


def length_feature(model_lengths: Sequence[int], baseline_lengths: Sequence[int]) -> np.ndarray:
    """tanh(d / sd(d)) of the length differences d (all 0 when the lengths never differ)."""
    d = np.asarray(model_lengths, dtype=float) - np.asarray(baseline_lengths, dtype=float)
    sd = d.std(ddof=1) if len(d) > 1 else 0.0
    return np.tanh(d / sd) if sd > 0 else np.zeros_like(d)


def lc_win_rate(scores: Sequence[float], model_lengths: Sequence[int], baseline_lengths: Sequence[int],
                *, confidence: float = 0.95, resamples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(lc, lower, upper): the length-controlled win rate sigmoid(a) and its percentile bootstrap interval."""
    y = np.asarray(scores, dtype=float)
    x = length_feature(model_lengths, baseline_lengths)

    def lc(idx: np.ndarray) -> float:
        a, _ = fit_length_logistic(y[idx], x[idx])
        return 1 / (1 + math.exp(-a))

    point = lc(np.arange(len(y)))
    rng = np.random.default_rng(seed)
    boot = np.array([lc(rng.integers(0, len(y), len(y))) for _ in range(resamples)])
    tail = (1 - confidence) / 2
    return point, float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))


# --------------------------------------------------------------------------- asking the judge


@dataclass
class Verdicts:
    """One model against the baseline: per prompt, the two replies, their readings and the score (None: a reply
    was not read, the pair is left out)."""

    forward: list[str]
    reverse: list[str]
    readings: list[tuple[str | None, str | None]]
    scores: list[float | None]

    @property
    def unparsed(self) -> int:
        """Replies that named no verdict."""
        return len(self.unparsed_replies())

    def unparsed_replies(self) -> list[str]:
        """The replies that named no verdict, model-first order's before baseline-first's."""
        return ([t for t, (f, _) in zip(self.forward, self.readings, strict=True) if f is None]
                + [t for t, (_, r) in zip(self.reverse, self.readings, strict=True) if r is None])

    def distribution(self) -> dict[str, dict[str, int]]:
        """Per order, how often the judge picked the answer shown first, second, a tie, or nothing readable:
        {"model_first": {"first": n, "second": n, "tie": n, "unparsed": n}, "baseline_first": {...}}."""
        names = {"1": "first", "2": "second", "tie": "tie", None: "unparsed"}
        out = {}
        for order, readings in (("model_first", [f for f, _ in self.readings]),
                                ("baseline_first", [r for _, r in self.readings])):
            out[order] = {name: sum(names[v] == name for v in readings) for name in names.values()}
        return out

    def kept(self, model_lengths: Sequence[int], baseline_lengths: Sequence[int]
             ) -> tuple[list[float], list[int], list[int]]:
        """(scores, model lengths, baseline lengths) of the pairs read in both orders."""
        kept = [(s, m, b) for s, m, b in zip(self.scores, model_lengths, baseline_lengths, strict=True)
                if s is not None]
        return [s for s, _, _ in kept], [m for _, m, _ in kept], [b for _, _, b in kept]


def judge_pairs(ask: Ask, template: str, instructions: list[str], model_texts: list[str],
                baseline_texts: list[str]) -> Verdicts:
    """Ask for both orders of every pair in one batch (the judge sees 2n prompts)."""
    triples = list(zip(instructions, model_texts, baseline_texts, strict=True))
    forward = [render(template, i, m, b) for i, m, b in triples]
    reverse = [render(template, i, b, m) for i, m, b in triples]
    replies = ask(forward + reverse)
    fwd, rev = replies[:len(forward)], replies[len(forward):]
    readings = [(parse_verdict(f), parse_verdict(r)) for f, r in zip(fwd, rev, strict=True)]
    return Verdicts(fwd, rev, readings, [pair_score(f, r) for f, r in readings])


def summary(verdicts: Verdicts, model_lengths: Sequence[int], baseline_lengths: Sequence[int], *,
            confidence: float, resamples: int, seed: int) -> dict[str, Any]:
    """The table columns of one judged model (`judge.*`), over the pairs read in both orders: the rates and their
    intervals (None when no pair was read), `judge.pairs` (how many), `judge.unparsed` (replies not read) and
    `judge.consistent` (share of read pairs whose two orders agree)."""
    scores, ml, bl = verdicts.kept(model_lengths, baseline_lengths)
    read = [(f, r) for f, r in verdicts.readings if f is not None and r is not None]
    counts = {"judge.pairs": len(scores), "judge.unparsed": verdicts.unparsed,
              "judge.consistent": round(sum(consistent(f, r) for f, r in read) / len(read), 4) if read else None}
    names = ("win_rate", "win_rate_low", "win_rate_high", "lc_win_rate", "lc_win_rate_low", "lc_win_rate_high")
    if not scores:
        return {**{f"judge.{k}": None for k in names}, **counts}
    rate, low, high = win_rate(scores, confidence)
    lc, lc_low, lc_high = lc_win_rate(scores, ml, bl, confidence=confidence, resamples=resamples, seed=seed)
    values = dict(zip(names, (rate, low, high, lc, lc_low, lc_high), strict=True))
    return {**{f"judge.{k}": round(v, 4) for k, v in values.items()}, **counts}


def distribution_text(distribution: dict[str, dict[str, int]]) -> str:
    """"model first: first 8, second 0, tie 0, unparsed 0; baseline first: ..." (a report line)."""
    return "; ".join(f"{order.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                     for order, counts in distribution.items())


def instruction_text(prompt: Any) -> str:
    """A prompt as the judge reads it: a string as is; chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return str(prompt[0]["content"])
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def endpoint_judge(client: OpenAIClient, model: str, *, max_new_tokens: int, concurrency: int) -> Ask:
    """Replies of a chat model at an OpenAI-compatible endpoint (greedy: temperature 0)."""

    def one(text: str) -> str:
        return client.chat(model, [{"role": "user", "content": text}], max_tokens=max_new_tokens, temperature=0.0)

    def ask(prompts: list[str]) -> list[str]:
        pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts))))
        try:
            futures = [pool.submit(one, p) for p in prompts]
            return [f.result() for f in futures]
        finally:  # on the first failure, the requests not yet started are dropped, not retried one by one
            pool.shutdown(wait=True, cancel_futures=True)

    return ask


def local_judge(folder: str, *, device: str, dtype: str, max_new_tokens: int, batch_size: int) -> Ask:
    """Greedy replies of a local chat model folder (the project's generation)."""
    from stages import generation
    from stages.generation import SamplingParams
    from stages.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, dtype=dtype, device=device)

    def ask(prompts: list[str]) -> list[str]:
        gens = generation.generate(model, tokenizer, [[{"role": "user", "content": p}] for p in prompts],
                                   SamplingParams(max_new_tokens=max_new_tokens), batch_size=batch_size)
        return list(gens.completions)

    return ask


def make_judge(j, *, device: str, dtype: str, env=None) -> tuple[Ask, OpenAIClient | None]:
    """The judge of `evaluate.judge` (`j`) and, for an endpoint, its client (whose retries are counted).
    env: where the key's variable is read (default: the process environment at call time)."""
    env = os.environ if env is None else env
    if j.model_path:
        return local_judge(j.model_path, device=device, dtype=dtype, max_new_tokens=j.max_new_tokens,
                           batch_size=j.concurrency), None
    key = None
    if j.api_key_env:
        key = env.get(j.api_key_env)
        if not key:
            raise JudgeError(f"evaluate.judge.api_key_env = {j.api_key_env!r}: that environment variable is not set; "
                             f"export {j.api_key_env}=<your key> (the key itself never goes into params)")
    client = OpenAIClient(j.base_url, key, timeout=j.timeout, max_retries=j.max_retries, backoff=j.backoff)
    return endpoint_judge(client, j.model, max_new_tokens=j.max_new_tokens, concurrency=j.concurrency), client
