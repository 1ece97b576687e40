"""A pairwise judge that is not the reward model the policy was trained against.

The judge is an OpenAI-compatible endpoint (`evaluate.judge.base_url` and `model`, the key read from the
environment variable *named* by `api_key_env`) or a local model folder (`model_path`). For each prompt it
sees a model's completion and the baseline's (SFT by default) twice, in both orders, so a judge that
favours the first (or second) answer cancels out; a tie, or a reply that names neither, counts one half.

Reported per model, each with a two-sided interval at `confidence`:
- `win_rate`: the mean over prompts of the two orders' mean verdict (normal interval of that mean);
- `lc_win_rate`: AlpacaEval 2's length-controlled win rate. A logistic regression of the per-prompt
  verdict on tanh(length difference / its standard deviation) separates the part of the preference that
  length explains; the win rate predicted at a length difference of 0 is sigmoid(intercept). Its interval
  is the percentile bootstrap over prompts (seeded, so reruns agree).

The judge's prompt is a text file with `{instruction}`, `{output_1}` and `{output_2}` (the shipped one:
`stages/evaluation/prompts/pairwise.txt`); the reply is read as 1, 2 or tie.
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

DEFAULT_PROMPT = Path(__file__).resolve().parent / "prompts" / "pairwise.txt"
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


def parse_verdict(reply: str) -> str | None:
    """"1", "2", "tie", or None when the reply names none of them (counted as a tie, and counted apart)."""
    m = re.search(r"\b(tie|1|2)\b", reply.strip().lower())
    return m.group(1) if m else None


def pair_score(forward: str | None, reverse: str | None) -> float:
    """The model's score on one prompt: forward shows (model, baseline), reverse (baseline, model).
    Each order gives 1 (model better), 0 (baseline better) or 1/2 (tie or unreadable); the score is their mean."""
    f = {"1": 1.0, "2": 0.0}.get(forward or "", 0.5)
    r = {"2": 1.0, "1": 0.0}.get(reverse or "", 0.5)
    return (f + r) / 2


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
    """One model against the baseline: per prompt, the two replies, their readings and the score."""

    forward: list[str]
    reverse: list[str]
    scores: list[float]
    unreadable: int


def judge_pairs(ask: Ask, template: str, instructions: list[str], model_texts: list[str],
                baseline_texts: list[str]) -> Verdicts:
    """Ask for both orders of every pair in one batch (the judge sees 2n prompts)."""
    triples = list(zip(instructions, model_texts, baseline_texts, strict=True))
    forward = [render(template, i, m, b) for i, m, b in triples]
    reverse = [render(template, i, b, m) for i, m, b in triples]
    replies = ask(forward + reverse)
    fwd, rev = replies[:len(forward)], replies[len(forward):]
    parsed = [(parse_verdict(f), parse_verdict(r)) for f, r in zip(fwd, rev, strict=True)]
    return Verdicts(fwd, rev, [pair_score(f, r) for f, r in parsed],
                    sum((f is None) + (r is None) for f, r in parsed))


def summary(verdicts: Verdicts, model_lengths: Sequence[int], baseline_lengths: Sequence[int], *,
            confidence: float, resamples: int, seed: int) -> dict[str, Any]:
    """The table columns of one judged model (`judge.*`)."""
    rate, low, high = win_rate(verdicts.scores, confidence)
    lc, lc_low, lc_high = lc_win_rate(verdicts.scores, model_lengths, baseline_lengths, confidence=confidence,
                                      resamples=resamples, seed=seed)
    values = {"win_rate": rate, "win_rate_low": low, "win_rate_high": high, "lc_win_rate": lc,
              "lc_win_rate_low": lc_low, "lc_win_rate_high": lc_high}
    return {**{f"judge.{k}": round(v, 4) for k, v in values.items()}, "judge.unreadable": verdicts.unreadable}


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
