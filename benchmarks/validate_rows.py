"""Params validation with and without the row checks (`data.validate_rows`), on a file of N rows.

    python -m benchmarks validate_rows                  # 100,000 SFT rows, chat messages
    python -m benchmarks validate_rows --rows 1000000 --caps 100000 -1
    git archive BASE | tar -x -C /tmp/base && python -m benchmarks validate_rows --status-code /tmp/base

Each variant runs in a fresh process (no cached peek or row check), alternated over `--rounds`
rounds; the figure is the median seconds. `load_params(rows=False)` is what `align status`,
`dvc-yaml` and launched ranks pay; `rows=True` is what `align run` and `python -m stages preprocess`
pay before anything is built. `python -m stages status` is the whole process (interpreter start,
imports, validation, the stage table), with this checkout's code and, with `--status-code`,
another's (e.g. one without the row checks). Prints the load average beside the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT as REPO
from benchmarks.common import host_load

TIMED = """
import sys, time
from stages.harness.params_loader import load_params
start = time.perf_counter()
load_params(sys.argv[1], sys.argv[3:], rows=sys.argv[2] == "1")
print(time.perf_counter() - start)
"""


def write_data(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i % 97}?"},
                                             {"role": "assistant", "content": str(i + i % 97)}]}) + "\n")


def timed(params: Path, rows: bool, sets: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", TIMED, str(params), "1" if rows else "0", *sets], env=env,
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def timed_status(params: Path, code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(code)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages", "status", "--params", str(params)], env=env, cwd=params.parent,
                   capture_output=True, text=True, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--caps", type=int, nargs="+", default=[100_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--status-code", type=Path, action="append", default=[], help="also time status with this "
                    "checkout's code")
    ap.add_argument("--tiny", action="store_true", help="1,000 rows, one round (the test suite's smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.rounds, args.caps = 1000, 1, [100]
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_data(folder / "sft.jsonl", args.rows)
        def params_of(code: Path, name: str) -> Path:  # each checkout's own params.yaml, reading the same file
            raw = yaml.safe_load((code / "params.yaml").read_text())
            raw["data"].update(source=None, sft=str(folder / "sft.jsonl"))
            raw["score"].update(reward_functions=["exact_match"], reward_weights=None)
            raw["run"]["output_dir"] = str(folder / "artifacts")
            (folder / name).write_text(yaml.safe_dump(raw))
            return folder / name

        params_of(REPO, "params.yaml")
        variants = [("load_params, no row checks", False, [])] + [
            (f"load_params, rows checked, data.validate_rows={cap}", True, [f"data.validate_rows={cap}"])
            for cap in args.caps]
        codes = [("python -m stages status (this checkout)", REPO, folder / "params.yaml")] + [
            (f"python -m stages status ({code})", code, params_of(code, f"params-{i}.yaml"))
            for i, code in enumerate(args.status_code)]
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants} | {name: [] for name, _, _ in codes}
        for _ in range(args.rounds):
            for name, rows, sets in variants:
                times[name].append(timed(folder / "params.yaml", rows, sets))
            for name, code, params in codes:
                times[name].append(timed_status(params, code))
        size = (folder / "sft.jsonl").stat().st_size / 2**20
        print(f"{args.rows} rows, {size:.1f} MiB, median of {args.rounds} fresh processes, load average "
              f"{host_load():.1f}")
        width = max(map(len, times))
        print(f"| {'what':<{width}} | seconds |\n|{'-' * (width + 2)}|---------|")
        for name, values in times.items():
            print(f"| {name:<{width}} | {statistics.median(values):7.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
