"""examples/: each script runs as a user runs it, in a subprocess, and does what it says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gguf_files import needs_smollm2

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_trl_quickstart_trains_every_trainer(tmp_path):
    """TRL's SFT (a conversational `messages` Dataset, with and without LoRA; plain text with LoRA), DPO, GRPO,
    KTO, reward, RLOO and distillation snippets with the import changed: 2 steps each, a finite loss,
    and the trainable weights changed (all of them; with LoRA, at least every adapter's B matrix, which
    starts at zero and is the first to move)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_quickstart.py"), "--out", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    runs = {r["trainer"]: r for r in map(json.loads, (line for line in res.stdout.splitlines()
                                                      if line.startswith('{"trainer"')))}
    assert list(runs) == ["SFT", "SFT-LoRA", "SFT-text", "DPO", "GRPO", "KTO", "Reward", "RLOO", "Distillation"]
    assert [name for name, run in runs.items() if run["peft"]] == ["SFT-LoRA", "SFT-text", "DPO"]
    for run in runs.values():
        assert run["finite"], run
        if run["peft"]:
            assert run["trainable"] > 0 and run["changed"] >= run["trainable"] // 2, run
        else:
            assert run["changed"] == run["trainable"] > 0, run


def _run_trl_tools(tmp_path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_tools.py"), "--out", str(tmp_path), *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    (run,) = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"example"')]
    return run


@needs_smollm2
def test_trl_tools_snippet_runs_on_a_tiny_model(tmp_path):
    """TRL's tool-calling GRPO snippet, import changed, 2 steps on a random 1-layer Llama with SmolLM2's tokenizer
    and align's tool template: it trains (a finite loss), logs the tool metrics and an episode."""
    run = _run_trl_tools(tmp_path, "--tiny", "--steps", "2")
    assert run["finite"] and run["trainable"] > 0 and run["tool_calls"] >= 0 and run["transcript"]


@pytest.mark.slow
@needs_smollm2
def test_trl_tools_snippet_on_smollm2_trains(tmp_path):
    """The same snippet on the real SmolLM2-135M-Instruct (never taught this tool format: it seldom calls the tool
    yet): the loss is finite and the weights move."""
    run = _run_trl_tools(tmp_path, "--steps", "2")
    assert run["finite"] and run["changed"] > 0 and run["tool_calls"] >= 0, run
