"""`align run` and `align stage` failing for real: the cause is the last line, the traceback is in the log file.

Through Prefect a failed stage used to print two traceback walls (the task's, then the flow's) and
its message somewhere in the middle; now the console has one line per record and no traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_inputs.test_last_line import assert_failure_reported, bad_data
from tests.conftest import write_params

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def align(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_LOGGING_LEVEL": "INFO"}
    res = subprocess.run([str(BIN / "align"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    return res.returncode, (res.stdout + res.stderr).rstrip("\n").splitlines()


def test_align_run_stage_failure(tmp_path):
    write_params(tmp_path, {"data": {"source": "d.jsonl", "validate_rows": 0}})  # left to preprocess
    bad_data(tmp_path)
    rc, lines = align(tmp_path, "run")
    assert rc == 1
    assert_failure_reported(lines, "align run, a bad data row in preprocess")
    assert len(lines) < 20, "\n".join(lines)


def test_align_stage_failure(tmp_path):
    write_params(tmp_path, {"data": {"source": "d.jsonl", "validate_rows": 0}})  # left to preprocess
    bad_data(tmp_path)
    rc, lines = align(tmp_path, "stage", "preprocess")
    assert rc == 1
    assert_failure_reported(lines, "align stage preprocess, a bad data row")
