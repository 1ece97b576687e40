"""Benchmark the quickstart: the main job from scratch, the all-cached rerun, and `dvc repro` no-op.

    python -m benchmarks pipeline            # default params.yaml (the quickstart), ~2 minutes
    python -m benchmarks pipeline --skip-dvc
    python -m benchmarks pipeline --busy 1   # the same beside one CPU-bound process (a shared machine)
    python -m benchmarks pipeline --set run.threads=auto   # any param override (the DVC rows are then skipped)

Runs in a temporary copy of the project (git + DVC initialised, its own PREFECT_HOME) so it
never touches your artifacts/ or Prefect database, and prints one table. Like `make run`, it
starts the background Prefect server first; the last rerun goes without it (ephemeral mode).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import ROOT, host_load, tiny_overrides
from stages.harness.registry import STAGES

BIN = Path(sys.executable).parent


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return elapsed, res.stdout


# A CPU-bound neighbour: another training job's matmuls, on as many torch threads as given
BUSY = ("import torch, sys; torch.set_num_threads(int(sys.argv[1])); a = torch.randn(512, 512)\n"
        "while True: a = (a @ a).tanh()")


@contextmanager
def neighbours(count: int, threads: int):
    """`count` CPU-bound processes running beside the benchmark until it ends."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(threads)]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-dvc", action="store_true")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="run beside N CPU-bound processes")
    ap.add_argument("--busy-threads", type=int, default=1, help="torch threads of each busy process")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a param override for every align run (repeatable)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny model and data (a smoke run: no ephemeral-mode or DVC rows)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.overrides = tiny_overrides() + args.overrides
    with neighbours(args.busy, args.busy_threads):
        run(args)
    return 0


def run(args) -> None:
    """Every measurement in a temporary copy of the project; its server is stopped and the copy removed after."""
    work = Path(tempfile.mkdtemp(prefix="align-bench-"))
    try:
        measure(args, work)
    finally:
        if (work / "repo").is_dir():  # a failed run leaves no server behind
            subprocess.run([str(BIN / "align"), "server", "stop"], cwd=work / "repo", capture_output=True,
                           env={**os.environ, "PREFECT_HOME": str(work / "prefect")})
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path) -> None:
    repo = work / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "artifacts", ".git", "__pycache__", ".dvc"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "DO_NOT_TRACK": "1", "DVC_NO_ANALYTICS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("PREFECT_API_URL", None)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "bench"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)

    rows = []
    server, _ = timed([str(BIN / "align"), "server", "start"], repo, env)  # what `make run` does first
    sets = [f"--set={o}" for o in args.overrides]
    load = host_load()
    first, out = timed([str(BIN / "align"), "run", *sets], repo, env)
    rows.append(("background Prefect server start (align server start)", f"{server:.1f} s"))
    rows.append(("main job, from scratch (align run)", f"{first:.1f} s"))
    evaluation = json.loads((repo / "artifacts" / "evaluate" / "metrics.json").read_text())
    for r in evaluation:
        rows.append((f"held-out accuracy, {r['model']} (n={r['n']})", f"{r['accuracy']:.1%}"))
    stages = {m: json.loads((repo / "artifacts" / m / "manifest.json").read_text())["wall_time_s"]
              for m in STAGES}
    rows += [(f"  stage {m}", f"{s:.1f} s") for m, s in stages.items()]
    rows.append(("  1-min load before / after the cold run", f"{load:.2f} / {host_load():.2f}"))
    second, out2 = timed([str(BIN / "align"), "run", *sets], repo, env)
    cached = sum(" cached " in line for line in out2.splitlines())
    rows.append((f"second run, nothing changed ({cached}/{len(STAGES)} cached)", f"{second:.1f} s"))
    subprocess.run([str(BIN / "align"), "server", "stop"], cwd=repo, env=env, capture_output=True)
    if not args.tiny:  # a third align process: the smoke run stops at the cached rerun
        ephemeral, out2 = timed([str(BIN / "align"), "run", *sets], repo, env)
        cached = sum(" cached " in line for line in out2.splitlines())
        rows.append((f"same, Prefect ephemeral mode, no server ({cached}/{len(STAGES)} cached)", f"{ephemeral:.1f} s"))
    if not (args.skip_dvc or args.overrides):  # with overrides, the flow rightly leaves dvc.lock alone
        dvc_first, _ = timed(["dvc", "repro"], repo, env)  # after the flow's dvc commit: nothing to run
        dvc_noop, out3 = timed(["dvc", "repro"], repo, env)
        rows.append(("dvc repro after the flow (nothing runs)", f"{dvc_first:.2f} s"))
        rows.append(("dvc repro no-op", f"{dvc_noop:.2f} s"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

