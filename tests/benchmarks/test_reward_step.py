"""benchmarks/reward_step.py: it runs the reward stage's own trainer (fp32 and bf16) and the bare steps, and prints
every case with a time and the trainer's overhead (timing comparisons are left to the benchmark's own runs)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reward_step_benchmark_prints_each_case():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reward_step.py"), "--steps", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    times = {k: float(v) for k, v in re.findall(r"^(\S.*?)\s+([\d.]+) ms  ", res.stdout, re.M)}
    assert set(times) == {"trainer, the stage's step", "bare step, pairs packed", "bare step, padded rows",
                          "trainer, reward.mixed_precision=bf16", "bare step, lower half frozen"}
    assert all(v > 0 for v in times.values())
    assert "trainer overhead per step:" in res.stdout
