"""Gates that know their sample size: confidence bounds for a share of successes, and the gates' rules.

A share measured on n items is an estimate; on 7 pairs one pair moves it by 14 points. The
gates judge a bound instead of the share itself:

- the reward gate (stage `reward`) passes when the one-sided Wilson lower bound of the held-out
  pair accuracy at `reward.gate_confidence` is at least `reward.min_accuracy`: at that
  confidence, the reward model ranks at least that share of pairs right. A perfect score
  passes only from `min_count(min_accuracy, confidence)` pairs on (16 at the default 0.85 and
  95%, 25 at 0.9); on the built-in task's 270 held-out pairs a measured 0.889 passes;
- the promotion gate (`stages.pipeline.promote`) promotes on a share metric (accuracy, format) when
  the one-sided lower bound of candidate − production (Newcombe's hybrid score interval,
  built from the two Wilson intervals) at `promote.confidence` is above
  `promote.min_improvement`: the candidate is better with that confidence, not by luck.

A confidence of 0.5 makes z = 0: every bound is the share itself (the gates of old). Pure
functions: no torch, no I/O.
"""
from __future__ import annotations

import math
from statistics import NormalDist


def z_value(confidence: float) -> float:
    """The one-sided normal quantile: P(Z <= z) = confidence (0.95 -> 1.6449; 0.5 -> 0)."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence = {confidence}: must be in [0.5, 1)")
    return NormalDist().inv_cdf(confidence)


def wilson_interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """(lower, upper): the Wilson score bounds of the share successes / n, each one-sided at `confidence`.

    center = (p + z²/2n) / (1 + z²/n), half = z·sqrt(p(1−p)/n + z²/4n²) / (1 + z²/n). Unlike
    p ± z·sqrt(p(1−p)/n) it stays inside [0, 1] and does not collapse to a point at p = 0 or 1."""
    if n <= 0:
        raise ValueError(f"n = {n}: a share needs at least one item")
    if not 0 <= successes <= n:
        raise ValueError(f"successes = {successes}: must be in [0, n = {n}]")
    z = z_value(confidence)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def wilson_lower(successes: int, n: int, confidence: float) -> float:
    return wilson_interval(successes, n, confidence)[0]


def min_count(threshold: float, confidence: float) -> int:
    """The fewest items on which a perfect score's lower bound reaches `threshold`: n / (n + z²) >= t, so
    n >= z² t / (1 − t). 0 when any count does (threshold 0 or confidence 0.5)."""
    z = z_value(confidence)
    if threshold <= 0 or z == 0:
        return 0
    if threshold >= 1:
        raise ValueError(f"threshold = {threshold}: a lower bound below 1 never reaches 1; use a threshold < 1")
    n = math.ceil(z * z * threshold / (1 - threshold) - 1e-9)
    return n if n / (n + z * z) >= threshold else n + 1


def difference_lower(successes_a: int, n_a: int, successes_b: int, n_b: int, confidence: float) -> float:
    """One-sided lower bound of share_a − share_b (two independent samples; Newcombe 1998, method 10):
    (p_a − p_b) − sqrt((p_a − l_a)² + (u_b − p_b)²), with l_a, u_b the Wilson bounds at `confidence`."""
    p_a, p_b = successes_a / n_a, successes_b / n_b
    l_a, _ = wilson_interval(successes_a, n_a, confidence)
    _, u_b = wilson_interval(successes_b, n_b, confidence)
    return (p_a - p_b) - math.sqrt((p_a - l_a) ** 2 + (u_b - p_b) ** 2)


def count_of(share: float, n: int) -> int:
    """The success count behind a share rounded for a table (0.8571 of 7 -> 6)."""
    return min(n, max(0, round(share * n)))


def reward_gate(accuracy: float, n: int, *, min_accuracy: float, confidence: float) -> tuple[bool, str]:
    """(passed, the sentence the stage logs or raises) of the reward gate on `n` held-out pairs."""
    correct = count_of(accuracy, n)
    lower = wilson_lower(correct, n, confidence)
    passed = lower >= min_accuracy
    pct = f"{confidence:.0%}"
    said = (f"held-out pair accuracy {accuracy:.3f} on {n} pairs ({correct} right; one-sided {pct} Wilson lower "
            f"bound {lower:.3f})")
    if passed:
        return True, f"{said} is at least reward.min_accuracy = {min_accuracy}"
    need = min_count(min_accuracy, confidence)
    short = (f" {n} pairs cannot show an accuracy of {min_accuracy} at {pct} confidence even if every pair is "
             f"right: at least {need} are needed (raise reward.eval_fraction or give more pairs)."
             if n < need else "")
    return False, f"{said} is below reward.min_accuracy = {min_accuracy}.{short}"


def held_out_pairs(pairs: int, eval_fraction: float, *, min_accuracy: float, confidence: float) -> tuple[str, str]:
    """("error" | "warning" | "", message) for the reward gate, from the preference pairs params validation
    counted: the stage holds out round(pairs · eval_fraction) of them (preprocess can only drop more).

    error: fewer than `min_count` held-out pairs, so even a reward model right on every one fails the gate;
    warning: so few that one right on (1 + min_accuracy) / 2 of them (0.95 at 0.9) would fail."""
    if min_accuracy <= 0:
        return "", ""
    held_out = min(max(1, round(pairs * eval_fraction)), pairs - 1) if pairs > 1 else pairs
    good = (1 + min_accuracy) / 2
    need = min_count(min_accuracy, confidence)
    comfortable = max(need, 1)
    while wilson_lower(count_of(good, comfortable), comfortable, confidence) < min_accuracy:
        comfortable += 1

    def fixes(target: int) -> str:
        fraction = math.ceil(100 * target / pairs) / 100
        better = f"; {fraction} holds out {target}" if fraction < 1 and target < pairs else ""
        return (f"raise reward.eval_fraction (now {eval_fraction}{better}), give more preference pairs, or lower "
                "reward.min_accuracy or reward.gate_confidence")

    if held_out < need:
        return "error", (f"reward.eval_fraction = {eval_fraction}: {pairs} preference pairs leave about {held_out} "
                         f"held out, fewer than the {need} on which the reward gate (reward.min_accuracy = "
                         f"{min_accuracy} at reward.gate_confidence = {confidence}) can pass even if every one is "
                         f"ranked right: the run would stop after SFT; {fixes(need)}")
    if held_out < comfortable:
        return "warning", (f"reward: about {held_out} held-out preference pairs (reward.eval_fraction = "
                           f"{eval_fraction} of {pairs}): a reward model right on {good:.0%} of them would still "
                           f"fail the gate (reward.min_accuracy = {min_accuracy} at {confidence:.0%} confidence; "
                           f"{comfortable} pairs would do); {fixes(comfortable)}")
    return "", ""
