"""The benchmark suite as a user runs it: `python -m benchmarks` lists every module, and every benchmark runs
end to end in its `--tiny` mode (`python -m benchmarks <name> --tiny`, a fresh process from the repository root).
A benchmark that cannot run here (TRL not installed, no CUDA GPU) exits 77 with the reason: the test skips."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from benchmarks.__main__ import NOT_BENCHMARKS, main, names
from tests.conftest import ROOT

# seconds; the others train, build models or run the pipeline (tens of seconds to minutes)
FAST = {"generation", "decode_matmul"}
SKIPPED = 77


def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_suite_lists_every_benchmark_module_and_refuses_an_unknown_name(capsys):
    found = names()
    expected = {"alignment", "efficacy", "generation", "gpu_check", "kernels", "peers", "pipeline", "sft"}
    assert expected <= set(found) and "common" not in found
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(re.search(rf"^  {name} +\S", listed, re.M) for name in found), listed
    assert main(["no_such_benchmark"]) == 2
    assert "unknown benchmark 'no_such_benchmark'; choose from: " in capsys.readouterr().err


def test_no_benchmark_edits_sys_path_or_runs_as_a_script():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert not re.search(r"python benchmarks/\w+\.py", text), path.name
        if path.stem not in ("__init__", "__main__", *NOT_BENCHMARKS):
            assert re.search(r"^def main\(argv[^)]*\) -> int:", text, re.M), path.name


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in names()])
@pytest.mark.filterwarnings("ignore")
def test_every_benchmark_runs_in_tiny_mode(name):
    start = time.perf_counter()
    done = run(name, "--tiny")
    out = done.stdout + done.stderr
    print(f"{name} --tiny: exit {done.returncode} in {time.perf_counter() - start:.1f} s")
    if done.returncode == SKIPPED:
        pytest.skip(next(line for line in done.stdout.splitlines() if ": skipped: " in line))
    assert done.returncode == 0, out[-4000:]
    assert done.stdout.strip(), f"{name} printed no figures"
