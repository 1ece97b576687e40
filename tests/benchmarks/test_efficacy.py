"""`python -m benchmarks efficacy`: ours vs TRL on tiny settings prints its table (one method, one seed, a few
steps)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("trl")

from tests.benchmarks.helpers import as_sets  # noqa: E402
from tests.conftest import SMALL  # noqa: E402


@pytest.fixture(scope="module")
def efficacy():
    from benchmarks import efficacy

    return efficacy


def test_the_one_reward_function_decodes_the_ids_itself(efficacy):
    from stages.builtin import tiny

    tok = tiny.build_tokenizer(384)
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text in (
        "<think>7+7=14, 4+6+1=11</think>114<|end|>", "<think>7+7=14, 4+6=10</think>104<|end|>",
        "<think>7+7=14, 114")]  # right, wrong, a block never closed (no answer)
    # TRL's `completions` for the first: skip_special_tokens drops the think tags and glues the numbers
    assert tok.decode(ids[0], skip_special_tokens=True).endswith("11114")
    reward = efficacy.final_number_reward(tok)
    assert reward(["p"] * 3, ["ignored"] * 3, completion_ids=ids, answer=["114"] * 3) == [1.0, 0.0, 0.0]


def test_tiny_sft_run_prints_the_table_for_both_sides(efficacy, tmp_path, capsys):
    small = {"model": SMALL["model"], "data": SMALL["data"], "evaluate": SMALL["evaluate"]}
    records = efficacy.run(["--methods", "sft", "--seeds", "1", "--sft-steps", "2", "--eval-samples", "4",
                            "--output-dir", str(tmp_path / "out"), "--write", str(tmp_path / "RESULTS.md"),
                            *as_sets(small)])
    printed = capsys.readouterr().out
    assert [(r["method"], r["side"], r["steps"]) for r in records] == [("sft", "ours", 2), ("sft", "trl", 2)]
    for side in ("ours", "trl"):
        assert re.search(rf"^\| sft \| {side} \| 1 \| \d+\.\d% \| [\d.]+ \| [\d.]+ \| 2 \|", printed, re.M), side
        assert re.search(rf"^\| sft \| {side} \| 1 \| \d+\.\d% ± \d+\.\d% \|", printed, re.M), side
    # same base weights, rows, order and hyperparameters: the same loss to float rounding
    assert records[0]["train_loss"] == pytest.approx(records[1]["train_loss"], rel=1e-4)
    assert "## Mean ± sd over seeds" in (tmp_path / "RESULTS.md").read_text()


def test_trainer_seed_moves_the_policy_seed_only(efficacy, tmp_path, monkeypatch):
    small = {"model": SMALL["model"], "data": SMALL["data"], "evaluate": SMALL["evaluate"]}
    seen = []
    real = efficacy.RUNNERS["dpo"]

    def spy(side, p, *args):
        seen.append((side, p.run.seed))
        return real(side, p, *args)

    monkeypatch.setitem(efficacy.RUNNERS, "dpo", spy)
    records = efficacy.run(["--methods", "dpo", "--seeds", "1", "--sides", "ours", "--dpo-steps", "1",
                            "--sft-steps", "1", "--eval-samples", "2", "--trainer-seed", "7",
                            "--output-dir", str(tmp_path / "out"), *as_sets(small)])
    assert seen == [("ours", 7)]
    assert [(r["method"], r["seed"], r["trainer_seed"]) for r in records] == [("dpo", 1, 7)]
    # the data and the SFT start still follow --seeds
    assert (tmp_path / "out" / "seed-1" / "sft-ours-model").is_dir()
