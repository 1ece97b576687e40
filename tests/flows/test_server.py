"""The deployment path for real: `prefect server start` on 127.0.0.1, `align serve`, `prefect deployment run`."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import write_params

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: process exited early: {p.stdout.read() if p.stdout else ''}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_and_run_full_deployment(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
    write_params(tmp_path, {"run": {"schedule": {"cron": "30 2 * * *", "timezone": "Europe/Paris"}}})
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    served = None
    try:
        wait_for(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 90, "prefect server",
                 [server])
        served = subprocess.Popen([str(BIN / "align"), "serve"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def deployments():
            req = urllib.request.Request(f"{api}/deployments/filter", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
            return {d["name"]: d for d in json.loads(urllib.request.urlopen(req, timeout=5).read())}

        wait_for(lambda: {"full", "nightly"} <= set(deployments()), 90, "deployments", [served])
        nightly = deployments()["nightly"]
        schedule = nightly["schedules"][0]["schedule"]
        assert schedule["cron"] == "30 2 * * *" and schedule["timezone"] == "Europe/Paris"
        assert nightly["paused"] is False

        res = subprocess.run([str(BIN / "prefect"), "deployment", "run", "align/full", "--watch",
                              "--watch-timeout", "300"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=360)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "Completed" in res.stdout, res.stdout
        assert (tmp_path / "artifacts" / "evaluate" / "manifest.json").exists()
    finally:
        if served is not None:
            stop(served)
        stop(server)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process `pid` and its descendants, from the kernel."""
    import psutil

    root = psutil.Process(pid)
    out = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            out |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return out


def test_background_server_listens_on_loopback_only(tmp_path, monkeypatch):
    """`align server start` (flows/server.py): every socket the server's processes listen on is 127.0.0.1."""
    from flows import server

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    url = server.start_server(port=free_port(), timeout=120)
    try:
        pid = json.loads((tmp_path / "prefect-home" / "align-server.json").read_text())["pid"]
        sockets = listening(pid)
        assert sockets and {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
        assert int(url.split(":")[-1].split("/")[0]) in {port for _, port in sockets}
    finally:
        assert server.stop_server()


def test_ephemeral_server_listens_on_loopback_only(tmp_path, monkeypatch):
    """Without PREFECT_API_URL a flow run starts Prefect's temporary server: from inside the flow, every
    listening socket of this process and its children is 127.0.0.1 (none on 0.0.0.0 or ::)."""
    from prefect import flow

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # 20 s is short on a loaded machine

    @flow
    def probe() -> list:
        return sorted(listening(os.getpid()))

    sockets = probe()
    assert sockets and {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
