"""One SIGTERM stops `align serve` and `align run` within 5 s, with no process of theirs left running.

Real processes: `align` started as a subprocess in its own session, its process tree read with
psutil before the signal, every one of those processes checked gone after it. Without a
PREFECT_API_URL both run Prefect's temporary server as a child process (what a SIGTERMed
`align run` used to leave behind).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from flows.cli import RUN_STOPPED, SERVE_STOPPED
from tests.conftest import write_params
from tests.flows.test_server import free_port, stop, wait_for

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def start_align(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "align-output.txt"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_LOGGING_LEVEL": "INFO",
           **(env or {})}  # tests/conftest.py removed any PREFECT_API_URL: ephemeral mode unless `env` sets one
    proc = subprocess.Popen([str(BIN / "align"), *args], cwd=tmp_path, env=env, stdout=out.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def alive(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def sigterm_and_time(proc: subprocess.Popen) -> tuple[list[psutil.Process], float]:
    """The process tree before the signal, and the seconds until `proc` exited."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    return tree, time.monotonic() - start


def last_line(out: Path) -> str:
    return out.read_text().rstrip("\n").splitlines()[-1]


def test_sigterm_stops_align_run_and_its_temporary_server(tmp_path):
    write_params(tmp_path, {"sft": {"max_steps": 100000, "logging_steps": 50}})
    proc, out = start_align(tmp_path, "run")
    try:
        # sft training, in the flow's worker thread, beside Prefect's temporary server
        wait_for(lambda: (tmp_path / "artifacts" / "preprocess" / "manifest.json").exists()
                 and psutil.Process(proc.pid).children(), 240, "align run reaching sft", [proc])
        time.sleep(2)
        tree, seconds = sigterm_and_time(proc)
        print(f"\n[align run] SIGTERM -> exit {proc.returncode} in {seconds:.1f} s; processes before: "
              f"{len(tree)}; last line: {last_line(out)}")
        assert seconds < 5, out.read_text()[-3000:]
        assert len(tree) >= 2, "no temporary Prefect server was running"
        assert not alive(tree), alive(tree)
        assert proc.returncode == 143
        assert last_line(out) == RUN_STOPPED
    finally:
        stop(proc)


def deployments(api: str) -> dict:
    req = urllib.request.Request(f"{api}/deployments/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    return {d["name"]: d for d in json.loads(urllib.request.urlopen(req, timeout=5).read())}


def test_sigterm_stops_align_serve_with_its_temporary_server(tmp_path):
    write_params(tmp_path)
    proc, out = start_align(tmp_path, "serve")
    try:
        wait_for(lambda: "serving align/full, align/nightly" in out.read_text()
                 and psutil.Process(proc.pid).children(), 120, "align serve", [proc])
        time.sleep(3)  # the runner polling its deployments
        tree, seconds = sigterm_and_time(proc)
        print(f"\n[align serve] SIGTERM -> exit {proc.returncode} in {seconds:.1f} s; processes before: "
              f"{len(tree)}; last line: {last_line(out)}")
        assert seconds < 5, out.read_text()[-3000:]
        assert len(tree) >= 2, "no temporary Prefect server was running"
        assert not alive(tree), alive(tree)
        assert last_line(out) == SERVE_STOPPED
    finally:
        stop(proc)


def test_sigterm_leaves_the_nightly_schedule_active(tmp_path):
    """Against a Prefect server of its own: stopped in < 5 s, and the deployments are not paused."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    write_params(tmp_path)
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env={**os.environ, **env}, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    proc = None
    try:
        wait_for(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 90, "prefect server",
                 [server])
        proc, out = start_align(tmp_path, "serve", env=env)
        wait_for(lambda: {"full", "nightly"} <= set(deployments(api)), 90, "deployments", [proc])
        time.sleep(2)
        tree, seconds = sigterm_and_time(proc)
        print(f"\n[align serve, own server] SIGTERM -> exit in {seconds:.1f} s; last line: {last_line(out)}")
        assert seconds < 5, out.read_text()[-3000:]
        assert not alive(tree), alive(tree)
        assert last_line(out) == SERVE_STOPPED
        assert deployments(api)["nightly"]["paused"] is False
    finally:
        if proc is not None:
            stop(proc)
        stop(server)
