"""The judge's pure parts: reading verdicts, cancelling position bias, the win rate and the length-controlled one."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stages.evaluation import judge


def test_verdicts_are_read_and_both_orders_cancel_position_bias():
    replies = ["1", " 2.", "Tie", "**2**", "Answer 1 is better", "The answer that is better is answer 1.",
               "It's a tie.", "1\n\nThe answer 1 is correct", "neither", "12", "15", "The answer is 42.",
               "Answer 2 is wrong; answer 1 is right", "1.5", "Answer 1 or 2", "The answer that is better is 1",
               "The better one is 2.", "1+1=2", "1 + 1 = 2", "Answer 1: 12+34=46", "It is 2 or 1", "tie: 1",
               "1. 25+60", "1. 1\n\nThe answer", "2, because"]
    assert [judge.parse_verdict(t) for t in replies] == \
        ["1", "2", "tie", "2", "1", "1", "tie", "1", None, None, None, None, None, None, None, "1", "2", None, None,
         "1", None, "tie", "1", "1", "2"]
    # forward shows (model, baseline), reverse (baseline, model)
    assert judge.pair_score("1", "2") == 1.0  # model preferred in both orders
    assert judge.pair_score("1", "1") == 0.5  # a judge that always picks the first answer: no information
    assert judge.pair_score("2", "2") == 0.5  # ... or always the second
    assert judge.pair_score("tie", "2") == 0.75
    assert judge.pair_score(None, "1") is None and judge.pair_score("2", None) is None  # unread: no score, no tie
    assert [judge.consistent(f, r) for f, r in [("1", "2"), ("1", "1"), ("tie", "tie"), ("tie", "1")]] == \
        [True, False, True, False]


def test_judge_pairs_asks_both_orders_and_leaves_unparsed_pairs_out():
    seen = []

    def ask(prompts):
        seen.extend(prompts)
        # a judge that prefers whichever answer mentions "good"; unreadable on the last reverse prompt
        return ["1" if p.index("good") < p.index("Answer 2:") else "2" for p in prompts[:-1]] + ["hmm"]

    v = judge.judge_pairs(ask, "{instruction}|Answer 1: {output_1}|Answer 2: {output_2}", ["q1", "q2", "q3"],
                          ["good a", "bad b", "good e"], ["bad c", "good d", "bad f"])
    assert seen == ["q1|Answer 1: good a|Answer 2: bad c", "q2|Answer 1: bad b|Answer 2: good d",
                    "q3|Answer 1: good e|Answer 2: bad f",
                    "q1|Answer 1: bad c|Answer 2: good a", "q2|Answer 1: good d|Answer 2: bad b",
                    "q3|Answer 1: bad f|Answer 2: good e"]
    assert v.scores == [1.0, 0.0, None] and v.unparsed == 1 and v.unparsed_replies() == ["hmm"]
    assert v.distribution() == {"model_first": {"first": 2, "second": 1, "tie": 0, "unparsed": 0},
                                "baseline_first": {"first": 1, "second": 1, "tie": 0, "unparsed": 1}}
    cols = judge.summary(v, [3, 4, 5], [3, 4, 9], confidence=0.95, resamples=50, seed=0)
    # q3 is left out: the rates are over q1 (1) and q2 (0), not a half for q3
    assert cols["judge.win_rate"] == 0.5 and cols["judge.pairs"] == 2 and cols["judge.unparsed"] == 1
    assert cols["judge.consistent"] == 1.0
    assert v.kept([3, 4, 5], [3, 4, 9]) == ([1.0, 0.0], [3, 4], [3, 4])


def test_a_judge_that_reads_positions_only_is_visible():
    """Always "1": every read pair scores 1/2 and no pair is consistent; nothing readable: no rates, all counted."""
    always_first = judge.judge_pairs(lambda ps: ["1"] * len(ps), "{instruction}{output_1}{output_2}", ["a", "b"],
                                     ["x", "y"], ["z", "w"])
    cols = judge.summary(always_first, [1, 2], [2, 1], confidence=0.95, resamples=50, seed=0)
    assert cols["judge.win_rate"] == 0.5 and cols["judge.consistent"] == 0.0 and cols["judge.unparsed"] == 0
    assert always_first.distribution()["baseline_first"] == {"first": 2, "second": 0, "tie": 0, "unparsed": 0}
    mute = judge.judge_pairs(lambda ps: ["The answer is 42."] * len(ps), "{instruction}{output_1}{output_2}",
                             ["a", "b"], ["x", "y"], ["z", "w"])
    cols = judge.summary(mute, [1, 2], [2, 1], confidence=0.95, resamples=50, seed=0)
    assert cols["judge.win_rate"] is None and cols["judge.lc_win_rate"] is None
    assert cols["judge.pairs"] == 0 and cols["judge.unparsed"] == 4 and cols["judge.consistent"] is None
    assert "unparsed 2" in judge.distribution_text(mute.distribution())


def test_win_rate_interval_by_hand():
    """scores 1, 1, 0, 1/2: mean 5/8; deviations 3/8, 3/8, -5/8, -1/8, so the sample sd is
    sqrt((2·9 + 25 + 1)/64/3) = sqrt(44/192); the interval is 5/8 ± 1.96·sd/√4."""
    scores = [1.0, 1.0, 0.0, 0.5]
    mean, low, high = judge.win_rate(scores, 0.95)
    sd = math.sqrt(((3 / 8) ** 2 * 2 + (5 / 8) ** 2 + (1 / 8) ** 2) / 3)
    half = 1.959963984540054 * sd / 2
    assert mean == 0.625 and low == pytest.approx(0.625 - half) and high == pytest.approx(min(1.0, 0.625 + half))


def test_length_controlled_equals_raw_when_lengths_never_differ():
    """x = 0 for every prompt: the fit is sigmoid(a) = mean(y) (up to the tiny penalty), so LC = raw."""
    scores = [1.0, 0.5, 0.0, 1.0, 1.0, 0.75]
    lc, low, high = judge.lc_win_rate(scores, [5] * 6, [5] * 6, resamples=200)
    assert lc == pytest.approx(np.mean(scores), abs=1e-3)
    assert low <= lc <= high


def test_length_controlled_removes_a_preference_for_length():
    """The judge prefers the longer answer 90% of the time, whoever wrote it; the model is longer on 80% of the
    prompts. Its raw win rate is high (0.8·0.9 + 0.2·0.1 = 0.74), but at equal length it wins half the time."""
    rng = np.random.default_rng(0)
    n = 3000
    longer = rng.random(n) < 0.8
    model_len = np.where(longer, 40, 20) + rng.integers(-3, 4, n)
    base_len = np.where(longer, 20, 40) + rng.integers(-3, 4, n)
    wins = np.where(longer, rng.random(n) < 0.9, rng.random(n) < 0.1).astype(float)
    raw, _, _ = judge.win_rate(wins)
    lc, low, high = judge.lc_win_rate(wins, model_len, base_len, resamples=200)
    assert raw == pytest.approx(0.74, abs=0.02)
    assert lc == pytest.approx(0.5, abs=0.04) and low < 0.5 < high


def test_logistic_fit_recovers_known_coefficients():
    """Soft targets that are exactly sigmoid(0.3 + 1.2x): the fit returns (0.3, 1.2) up to the small penalty."""
    x = np.linspace(-1, 1, 201)
    y = 1 / (1 + np.exp(-(0.3 + 1.2 * x)))
    a, b = judge.fit_length_logistic(y, x, penalty=0.0)
    assert a == pytest.approx(0.3, abs=1e-6) and b == pytest.approx(1.2, abs=1e-6)


def test_a_prompt_file_without_its_fields_is_refused(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_text("Which is better? {output_1} or {output_2}")
    with pytest.raises(judge.JudgeError, match=r"lacks \['\{instruction\}'\]"):
        judge.read_template(bad)
    assert "{instruction}" in judge.read_template(None)


def test_instruction_text():
    assert judge.instruction_text("hi") == "hi"
    assert judge.instruction_text([{"role": "user", "content": "12+3"}]) == "12+3"
    assert judge.instruction_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == \
        "system: s\nuser: u"
