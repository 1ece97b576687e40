"""benchmarks/threads.py and the busy neighbour benchmarks/pipeline.py starts: they run, print a row per thread
count, and the neighbour really burns a core while it runs and is gone after."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_threads_benchmark_prints_a_row_per_count(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threads.py"), "--busy", "0", "--rounds", "1",
                          "--steps", "2", "--threads", "1", "2"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = re.findall(r"^\s+0\s+(\d)\s+fp32\s+([\d.]+)\s+([\d.]+)\s+[\d.]+$", res.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert "speed of 2 threads fp32 / 1 fp32" in res.stdout


def test_busy_neighbour_burns_cpu_until_the_benchmark_ends():
    sys.path.insert(0, str(ROOT))
    from benchmarks.pipeline import neighbours

    before = {p.pid for p in psutil.Process().children()}  # a test worker may have children of its own
    with neighbours(1, 1):
        kids = [p for p in psutil.Process().children() if p.pid not in before]
        assert len(kids) == 1
        time.sleep(2.0)
        busy = kids[0].cpu_times()
        assert busy.user + busy.system > 0.5  # CPU-bound (a share of a core even on a loaded machine), never idle
    assert not psutil.pid_exists(kids[0].pid) or kids[0].status() == psutil.STATUS_ZOMBIE
