"""`python -m benchmarks gpu_check`: its command line, its skip without CUDA, and (marker gpu) the run itself on a
GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", "gpu_check", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_names_the_model_and_the_options():
    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert "0.5B" in done.stdout and "--steps" in done.stdout and "--modes" in done.stdout


@pytest.fixture(scope="module")
def gpu_check():
    from benchmarks import gpu_check

    return gpu_check


def test_unknown_mode_is_refused(gpu_check, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--modes", "lora,fp8"])
    assert stop.value.code == 2 and "unknown ['fp8']; choose from lora, qlora" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the gpu-marked test runs instead")
def test_without_cuda_it_says_so_and_exits_77(gpu_check, capsys):
    assert gpu_check.main([]) == 77
    assert "gpu_check: skipped: no CUDA GPU is visible" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sft_dpo_grpo_on_a_half_billion_parameter_model(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = run("--steps", "4", "--json", str(out), timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout)  # pytest -s shows the table
    results = json.loads(out.read_text())
    assert [r["stage"] for r in results if r["mode"] == "lora"] == ["sft", "dpo", "grpo"]
    for r in results:
        assert r["peak_gib"] > 1.0 and r["tokens_per_s"] > 0, r  # bf16 weights alone are ~1 GiB
    for r in results:
        if r["stage"] == "dpo":  # the policy starts as its reference (adapter off)
            assert abs(r["step0_margin"]) < 1e-2, r
