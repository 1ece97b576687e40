"""benchmarks/decode.py: it runs, prints every case with a time, and its preallocated-cache experiment and the
"hf" backend's decoder decode the same token ids as transformers' default cache."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_benchmark_prints_each_case_and_the_same_ids():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--calls", "1", "--rounds", "1",
                          "--rows-large", "16"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    times = dict(re.findall(r"^(\S.*?)\s+([\d.]+) ms", res.stdout, re.M))
    assert {"one decode forward", "generate, default dynamic cache", "generate, preallocated cache",
            "generate, cache_implementation=static", "generate, one bf16 autocast region", "stages.generation.decoder",
            "generate, 16 rows", "stages.generation.decoder, 16 rows"} <= set(times)
    assert all(float(v) > 0 for v in times.values())
    assert "preallocated cache gives the same token ids as the default: True" in res.stdout
    assert "the decoder gives the same token ids as the default: True" in res.stdout
