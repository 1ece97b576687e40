"""`align run`'s closing summary prints an evaluation table whose rows have different columns (the judge's
baseline row has no judge.* columns)."""
from __future__ import annotations

from flows.cli import print_summary


def test_summary_table_with_a_judge_baseline_row(capsys):
    rows = [{"model": "base", "n": 2, "accuracy": 0.0, "judge.win_rate": 0.25},
            {"model": "sft", "n": 2, "accuracy": 0.5},  # the baseline: not judged against itself
            {"model": "merged", "n": 2, "accuracy": 1.0, "judge.win_rate": None}]
    print_summary({"stages": [], "evaluation": rows})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].split() == ["model", "n", "accuracy", "judge.win_rate"]
    assert [line.split() for line in lines[-3:]] == [["base", "2", "0.0", "0.25"], ["sft", "2", "0.5", "-"],
                                                     ["merged", "2", "1.0", "None"]]
