"""Exact values of the gates' statistics (stages/gates.py), each derived in its docstring."""
from __future__ import annotations

import math

import pytest

from stages import gates


def test_z_value():
    """Φ⁻¹(0.95) = 1.6448536…, Φ⁻¹(0.975) = 1.9599640…; 0.5 gives 0 (the bound is the share itself)."""
    assert gates.z_value(0.95) == pytest.approx(1.6448536269514722, abs=1e-12)
    assert gates.z_value(0.975) == pytest.approx(1.959963984540054, abs=1e-12)
    assert gates.z_value(0.5) == 0
    with pytest.raises(ValueError, match=r"confidence = 1: must be in \[0\.5, 1\)"):
        gates.z_value(1)


def test_wilson_interval_six_of_seven():
    """p = 6/7, n = 7, z² = 2.7055434: denominator 1 + z²/7 = 1.3865062; center (6/7 + z²/14) / 1.3865062
    = 0.7575847; half z·sqrt(p(1−p)/7 + z²/196) / 1.3865062 = 0.2098714 -> (0.5477133, 0.9674562)."""
    low, high = gates.wilson_interval(6, 7, 0.95)
    assert low == pytest.approx(0.5477133053029709, abs=1e-12)
    assert high == pytest.approx(0.9674561979452133, abs=1e-12)


def test_wilson_interval_at_the_edges():
    """All right: the lower bound is n / (n + z²) (300 / 302.7055434 = 0.9910621), the upper 1; none right: 0 and
    z² / (n + z²) (2.7055434 / 12.7055434 = 0.2129420); z = 0 collapses to the share."""
    assert gates.wilson_interval(300, 300, 0.95) == pytest.approx((300 / (300 + gates.z_value(0.95) ** 2), 1.0))
    assert gates.wilson_interval(0, 10, 0.95)[0] == 0
    assert gates.wilson_interval(0, 10, 0.95)[1] == pytest.approx(0.21294197008340685, abs=1e-12)
    assert gates.wilson_interval(3, 7, 0.5) == pytest.approx((3 / 7, 3 / 7))
    with pytest.raises(ValueError, match="n = 0"):
        gates.wilson_interval(0, 0, 0.95)


def test_wilson_matches_the_definition_it_replaces():
    """Against the bound found numerically: the smallest p0 whose score test (p − p0)/sqrt(p0(1−p0)/n) = z."""
    z = gates.z_value(0.95)
    for k, n in [(1, 7), (282, 300), (15, 40)]:
        p = k / n
        lo, hi = 0.0, p
        for _ in range(200):  # bisection on the score statistic, decreasing in p0 on [0, p]
            mid = (lo + hi) / 2
            score = (p - mid) / math.sqrt(mid * (1 - mid) / n) if 0 < mid < 1 else math.inf
            lo, hi = (mid, hi) if score > z else (lo, mid)
        assert gates.wilson_lower(k, n, 0.95) == pytest.approx(lo, abs=1e-9)


def test_min_count():
    """n / (n + z²) >= t  <=>  n >= z² t / (1 − t): 2.7055434 · 9 = 24.35 -> 25 at 0.9 and 95%; 1.9599640² · 9
    = 34.57 -> 35 at 97.5%; 2.7055434 · 4 = 10.82 -> 11 at 0.8; 0 without a gate or at confidence 0.5."""
    assert gates.min_count(0.9, 0.95) == 25
    assert gates.wilson_lower(25, 25, 0.95) >= 0.9 > gates.wilson_lower(24, 24, 0.95)
    assert gates.min_count(0.9, 0.975) == 35
    assert gates.min_count(0.8, 0.95) == 11
    assert gates.min_count(0.0, 0.95) == gates.min_count(0.9, 0.5) == 0


def test_difference_lower():
    """70% vs 65% on 300 each: Wilson bounds l_a = 0.6548517, u_b = 0.6937721; 0.05 − sqrt(0.0451483² +
    0.0437721²) = −0.0128837: not shown better. 80% vs 50% on 100 each: shown better by at least 0.1906."""
    assert gates.difference_lower(210, 300, 195, 300, 0.95) == pytest.approx(-0.012883717821049925, abs=1e-12)
    assert gates.difference_lower(80, 100, 50, 100, 0.95) == pytest.approx(0.19064219926411097, abs=1e-12)
    assert gates.difference_lower(80, 100, 50, 100, 0.5) == pytest.approx(0.3)


def test_reward_gate_messages():
    passed, message = gates.reward_gate(6 / 7, 7, min_accuracy=0.9, confidence=0.95)
    assert not passed and message == (
        "held-out pair accuracy 0.857 on 7 pairs (6 right; one-sided 95% Wilson lower bound 0.548) is below "
        "reward.min_accuracy = 0.9. 7 pairs cannot show an accuracy of 0.9 at 95% confidence even if every pair is "
        "right: at least 25 are needed (raise reward.eval_fraction or give more pairs).")
    # the built-in task's figures (README: 0.996 on 271 held-out pairs; 0.941 on about 300) pass
    assert gates.reward_gate(0.996, 271, min_accuracy=0.9, confidence=0.95) == (
        True, "held-out pair accuracy 0.996 on 271 pairs (270 right; one-sided 95% Wilson lower bound 0.984) is at "
              "least reward.min_accuracy = 0.9")
    assert gates.reward_gate(0.941, 300, min_accuracy=0.9, confidence=0.95)[0]
    assert not gates.reward_gate(0.926, 300, min_accuracy=0.9, confidence=0.95)[0]  # lower bound 0.898
    assert gates.reward_gate(0.926, 300, min_accuracy=0.9, confidence=0.5)[0]  # the share itself
    assert gates.reward_gate(0.0, 3, min_accuracy=0.0, confidence=0.95)[0]  # no gate


def test_held_out_pairs():
    level, message = gates.held_out_pairs(70, 0.1, min_accuracy=0.9, confidence=0.95)
    assert level == "error" and message == (
        "reward.eval_fraction = 0.1: 70 preference pairs leave about 7 held out, fewer than the 25 on which the "
        "reward gate (reward.min_accuracy = 0.9 at reward.gate_confidence = 0.95) can pass even if every one is "
        "ranked right: the run would stop after SFT; raise reward.eval_fraction (now 0.1; 0.36 holds out 25), give "
        "more preference pairs, or lower reward.min_accuracy or reward.gate_confidence")
    level, message = gates.held_out_pairs(300, 0.1, min_accuracy=0.9, confidence=0.95)
    assert level == "warning" and "a reward model right on 95% of them would still fail" in message
    assert "86 pairs would do" in message and "0.29 holds out 86" in message
    assert gates.held_out_pairs(3000, 0.1, min_accuracy=0.9, confidence=0.95) == ("", "")  # the built-in task
    assert gates.held_out_pairs(70, 0.1, min_accuracy=0.0, confidence=0.95) == ("", "")


def test_the_defaults_pass_the_builtin_task_on_every_measured_seed():
    """docs/decisions.md: held-out pair accuracy 0.978 / 0.941 / 0.915 / 0.919 on seeds 0-3 (about 270 pairs) with
    the default reward recipe; each passes the default gate, 7 pairs cannot (16 are needed)."""
    from stages.harness.config import RewardSection

    r = RewardSection()
    for accuracy in (0.978, 0.941, 0.915, 0.919):
        assert gates.reward_gate(accuracy, 270, min_accuracy=r.min_accuracy, confidence=r.gate_confidence)[0]
    assert not gates.reward_gate(1.0, 7, min_accuracy=r.min_accuracy, confidence=r.gate_confidence)[0]
    assert gates.min_count(r.min_accuracy, r.gate_confidence) == 16
