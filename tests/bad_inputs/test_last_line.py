"""What a person reads when `python -m stages` fails: the cause as the very last line of a real process.

Each case asserts the exact last line and prints it (`pytest -s` shows them). A failure inside a
stage also prints the path of the log file that holds its traceback; the console holds none.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import ROOT

UNREACHABLE_HUB = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


def run_stages(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, list[str], float]:
    """`python -m stages ...` run in `tmp_path`: (exit code, stderr lines, seconds)."""
    env = {**os.environ, "HF_ENDPOINT": UNREACHABLE_HUB, "HF_HOME": str(tmp_path / "hf-home"),
           "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("HF_HUB_OFFLINE", None)
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "stages", *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    return res.returncode, res.stderr.rstrip("\n").splitlines(), time.monotonic() - start


def show(case: str, lines: list[str]) -> str:
    print(f"\n[{case}] last line: {lines[-1]}")
    return lines[-1]


def test_unknown_key_suggests_the_closest_known_key(tmp_path, params_for):
    params = params_for()
    rc, lines, _ = run_stages(tmp_path, "sft", "--params", str(params), "--set", "sft.learnig_rate=1e-4")
    assert rc == 2
    assert show("unknown key", lines) == "  - sft.learnig_rate: unknown key; did you mean learning_rate?"


def test_unknown_key_without_a_close_one_lists_the_known_keys():
    from stages.harness.config import RunConfig
    from stages.harness.params_loader import build

    _, problems = build(RunConfig, {"zzz": 1}, "run.")
    assert problems[0].startswith("run.zzz: unknown key; known keys here: ") and "output_dir" in problems[0]


def test_bad_value(tmp_path, params_for):
    params = params_for()
    rc, lines, _ = run_stages(tmp_path, "sft", "--params", str(params), "--set", "sft.learning_rate=-1")
    assert rc == 2
    assert show("bad value", lines) == ("  - sft.learning_rate = -1: must be > 0 "
                                        "(The initial learning rate for the optimizer.)")


@pytest.mark.parametrize("name", ["models/my-qwen", "./my-qwen", "~/no-such-align-model", "my-qwen"])
def test_missing_local_model_fails_in_seconds_naming_the_folder(tmp_path, params_for, monkeypatch, name):
    """A relative, ./, ~ or bare path that is no folder: rejected at params validation, before anything is
    built, within 5 s (no hub retries), the folder named and the hub said not reachable or not tried."""
    monkeypatch.chdir(tmp_path)
    params = params_for({"model": {"name_or_path": name}})
    folder = Path(name).expanduser().resolve()
    if "/" in name and not name.startswith(("./", "~")):  # org/name: a hub id too, tried and not reachable
        expected = (f"  - model.name_or_path = {name!r}: no folder {folder}, and hub id {name!r} is not in the local "
                    f"Hugging Face cache; the hub ({UNREACHABLE_HUB}) is not reachable ([Errno 111] Connection "
                    "refused). Fix the path, or "
                    f"download the model where the hub is reachable (`hf download {name} --local-dir models/my-qwen`)"
                    " and point model.name_or_path at that folder")
    else:
        expected = (f"  - model.name_or_path = {name!r}: no folder {folder}; not a hub id (org/name) either, so the "
                    "hub was not tried. Fix the path")
    rc, lines, seconds = run_stages(tmp_path, "preprocess", "--params", str(params))
    assert rc == 2, lines
    assert show(f"missing model {name} ({seconds:.1f} s with interpreter start)", lines) == expected
    assert not (tmp_path / "artifacts").exists()  # nothing built, not even the logs folder

    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)  # read at import: the probe below takes the URL itself
    start = time.monotonic()
    with pytest.raises(ParamsError):
        load_params(params)
    assert time.monotonic() - start < 5


BAD_ROW = '{"prompt": "2+2=", "completion": 4, "x": }\n'  # column 42: a value is missing
STAGE_FAILURE = ("error: preprocess: d.jsonl: 1 bad row(s) of 2: d.jsonl:2: invalid JSON at column 42: Expecting "
                 "value; Fix the rows, or set data.on_bad_rows: skip to drop them (they are counted in the manifest).")


def bad_data(folder: Path) -> Path:
    (folder / "d.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n' + BAD_ROW)
    return folder / "d.jsonl"


def assert_failure_reported(lines: list[str], case: str) -> Path:
    """The cause last, the log file's path just before it; the traceback in that file, none on the console."""
    assert show(case, lines) == STAGE_FAILURE
    assert lines[-2].startswith("full log and traceback: "), lines[-2]
    log = Path(lines[-2].removeprefix("full log and traceback: "))
    assert "Traceback (most recent call last)" in log.read_text() and "DataError" in log.read_text()
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    return log


def test_stage_failure_ends_with_its_cause_and_the_log_path(tmp_path, params_for):
    params = params_for({"data": {"source": "d.jsonl", "validate_rows": 0}})  # the row left to preprocess
    bad_data(tmp_path)
    rc, lines, _ = run_stages(tmp_path, "preprocess", "--params", str(params))
    assert rc == 1
    log = assert_failure_reported(lines, "python -m stages preprocess, a bad data row")
    assert log.parent == tmp_path / "artifacts" / "logs"


def test_bad_row_and_params_problem_reported_in_one_pass(tmp_path, params_for):
    """SFT-only data with a bad row on line 2 and the default reward functions (which need preference data): one
    exit-2 message names the reward functions and the row, before anything is built."""
    (tmp_path / "sft.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"messages": "hello"}\n'
                                        '{"prompt": "2+2=", "completion": "4"}\n')
    params = params_for({"data": {"source": None, "sft": "sft.jsonl"},
                         "score": {"reward_functions": ["exact_match", "reward_model_prob"],
                                   "reward_weights": [1.0, 0.5]}})
    rc, lines, _ = run_stages(tmp_path, "preprocess", "--params", str(params))
    assert rc == 2, lines
    assert lines[-3] == f"error: {params}: 2 problem(s) in params; nothing was run or written:"
    assert lines[-2] == (
        "  - score.reward_functions = ['exact_match', 'reward_model_prob'] includes reward_model_prob, but there is no "
        "preference data to train one: set --set policy.method=grpo --set score.enabled=false (GRPO learns from the "
        "rule reward on every sample), or keep policy.method = dpo with --set score.reward_functions=[exact_match] "
        "--set score.reward_weights=[1.0] if the SFT model's samples are right on some prompts and wrong on others "
        "(score pairs only samples whose scores differ; with none the run stops before policy), or give "
        "data.preference")
    assert show("bad row and params problem", lines) == (
        "  - sft.jsonl:2: field 'messages' must be a non-empty list of messages, got str; fix the rows, or set "
        "data.on_bad_rows: skip to drop them (they are counted in the manifest)")
    assert not (tmp_path / "artifacts").exists()
