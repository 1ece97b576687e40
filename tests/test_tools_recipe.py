"""The tool-use recipe (configs/tools.yaml) on a slice: SFT learns to call the calculator, GRPO runs episodes that
call it, and evaluate answers every held-out prompt through the tool, its transcripts in the report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.harness.params_loader import load_params
from stages.harness.runner import run_stage

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # about 2 minutes on one thread


def test_the_tools_recipe_learns_to_call_the_tool_and_answers_through_it(tmp_path):
    small = {"data.builtin.num_train": 2000, "data.builtin.num_preference": 16, "data.builtin.num_eval": 24,
             "data.builtin.num_dev": 8, "sft.num_train_epochs": 2.0, "reward.max_steps": 1,
             "policy.num_prompts": 32, "policy.grpo.max_steps": 2, "policy.grpo.per_device_train_batch_size": 16,
             "policy.grpo.num_generations": 4, "policy.grpo.logging_steps": 1, "run.output_dir": str(tmp_path),
             "run.report_to": []}
    params = load_params(ROOT / "configs" / "tools.yaml", small)
    assert params.policy.grpo.tools == ["stages.builtin.arithmetic_tools.add"]
    manifests = {s: run_stage(s, params) for s in ("preprocess", "sft", "reward", "score", "reference", "policy",
                                                    "merge", "evaluate")}

    history = json.loads((tmp_path / "policy" / "log_history.json").read_text())
    calls = [h["tools/calls"] for h in history if "tools/calls" in h]
    assert calls and sum(calls) > 0, "GRPO's episodes made no tool call"
    assert manifests["policy"]["metrics"]["last"]["tools/call_frequency"] > 0.5

    table = {row["model"]: row for row in json.loads((tmp_path / "evaluate" / "metrics.json").read_text())}
    assert list(table) == ["base", "sft", "policy", "merged"]
    assert table["base"]["tool_calls_per_prompt"] < 0.5  # the untrained model does not call
    for model in ("sft", "policy", "merged"):
        assert table[model]["tool_calls_per_prompt"] > 0.5, model
    predictions = [json.loads(line) for line in (tmp_path / "evaluate" / "predictions.jsonl").read_text().splitlines()]
    sft = [p for p in predictions if p["model"] == "sft"]
    through_tool = [p for p in sft if '"name": "add"' in p["transcript"] and "[tool add]" in p["transcript"]]
    assert len(through_tool) > len(sft) // 2
    # the answer accuracy reads is the episode's last assistant turn, after the call and the tool's result
    answered = [p for p in through_tool if not p["transcript"].splitlines()[-1].startswith("[tool")
                and "<call" not in p["transcript"].splitlines()[-1]]
    assert answered
    for p in answered:
        assert p["completion"] == p["transcript"].splitlines()[-1] and "<call" not in p["completion"]
        assert p["correct"] == (p["answer"] is not None and p["answer"] == p["expected"])
    assert table["sft"]["accuracy"] == round(sum(p["correct"] for p in sft) / len(sft), 4)
    assert "[tool add]" in (tmp_path / "evaluate" / "report.md").read_text()
