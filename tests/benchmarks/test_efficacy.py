"""benchmarks/efficacy.py: ours vs TRL on tiny settings prints its table (one method, one seed, a few steps)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.conftest import SMALL  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def efficacy():
    spec = importlib.util.spec_from_file_location("efficacy_bench", ROOT / "benchmarks" / "efficacy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sets(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _sets(v, f"{prefix}{k}.") if isinstance(v, dict) else ["--set", f"{prefix}{k}={json.dumps(v)}"]
    return out


def test_the_one_reward_function_reads_both_sides_completions(efficacy):
    ours = ["so 132", "131", ""]  # ours: strings, reasoning already removed
    trl = [[{"role": "assistant", "content": "<think>2+9=11, 4+6=10+1</think>132"}],  # TRL: messages, reasoning kept
           [{"role": "assistant", "content": "<think>2+9=11, 132"}], [{"role": "assistant", "content": "132"}]]
    assert efficacy.final_number_reward([], ours, answer=["132", "132", "132"]) == [1.0, 0.0, 0.0]
    assert efficacy.final_number_reward([], trl, answer=["132"] * 3) == [1.0, 0.0, 1.0]  # an unclosed block: no answer


def test_tiny_sft_run_prints_the_table_for_both_sides(efficacy, tmp_path, capsys):
    small = {"model": SMALL["model"], "data": SMALL["data"], "evaluate": SMALL["evaluate"]}
    records = efficacy.main(["--methods", "sft", "--seeds", "1", "--sft-steps", "2", "--eval-samples", "4",
                             "--output-dir", str(tmp_path / "out"), "--write", "--results",
                             str(tmp_path / "RESULTS.md"), *_sets(small)])
    printed = capsys.readouterr().out
    assert [(r["method"], r["side"], r["steps"]) for r in records] == [("sft", "ours", 2), ("sft", "trl", 2)]
    for side in ("ours", "trl"):
        assert re.search(rf"^\| sft \| {side} \| 1 \| \d+\.\d% \| [\d.]+ \| [\d.]+ \| 2 \|", printed, re.M), side
        assert re.search(rf"^\| sft \| {side} \| 1 \| \d+\.\d% ± \d+\.\d% \|", printed, re.M), side
    # same base weights, rows, order and hyperparameters: the same loss to float rounding
    assert records[0]["train_loss"] == pytest.approx(records[1]["train_loss"], rel=1e-4)
    assert "## Mean ± sd over seeds" in (tmp_path / "RESULTS.md").read_text()
