"""A local Prefect server for `align run`, started once in the background and reused.

Prefect's ephemeral mode starts and stops a temporary server on every run (about 6-9 s on
2 cores), and its UI is gone when the run ends. Without a background server, `align run` starts that same
temporary server itself (`TemporaryServer`), first thing, so that it boots while the params are validated
instead of after; Prefect then finds it through PREFECT_API_URL. `align server start` starts
`prefect server start --host 127.0.0.1` in the background instead and records its address
in `$PREFECT_HOME/align-server.json`; `align run` uses it whenever PREFECT_API_URL is unset
and it answers. `make run` starts it, so the runs, logs and artifacts stay browsable at the
printed address. `align server stop` stops it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_PORT = 4200


def _home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()


def _state_file() -> Path:
    return _home() / "align-server.json"


def _healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/health", timeout=timeout).status == 200
    except OSError:
        return False


def find_server() -> str | None:
    """The API URL of the server `align server start` left running, if it still answers."""
    try:
        state = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return None
    return state["api_url"] if _healthy(state["api_url"]) else None


def _free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            # as uvicorn binds: connections of a server that just died (TIME_WAIT) must not push it to another port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise RuntimeError("no free port on 127.0.0.1")


def start_server(port: int = DEFAULT_PORT, timeout: float = 120) -> str:
    """Start (or find) the background server; return its API URL."""
    if url := find_server():
        return url
    port = _free_port(port)
    api_url = f"http://127.0.0.1:{port}/api"
    _home().mkdir(parents=True, exist_ok=True)
    log = open(_home() / "align-server.log", "ab")
    prefect = Path(sys.executable).parent / "prefect"
    proc = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {proc.returncode}; see {_home() / 'align-server.log'}")
        if _healthy(api_url):
            _state_file().write_text(json.dumps({"api_url": api_url, "pid": proc.pid}))
            return api_url
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError(f"prefect server did not answer within {timeout:.0f}s; see {_home() / 'align-server.log'}")


def stop_server() -> bool:
    try:
        state = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return False
    try:
        os.killpg(state["pid"], signal.SIGTERM)
    except ProcessLookupError:
        pass
    _state_file().unlink(missing_ok=True)
    return True


class TemporaryServer:
    """Prefect's temporary server, as its ephemeral mode runs it (uvicorn on the API app, UI off, a free port on
    127.0.0.1, the database in PREFECT_HOME), started without importing Prefect here: `start()` returns at once,
    `wait()` blocks until it answers, `stop()` ends it (registered at exit before Prefect is imported, so it runs
    after Prefect's own exit handlers have flushed their logs and events to it)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.api_url = ""

    def start(self) -> str:
        import atexit
        import importlib.util

        port = _free_port(0)
        self.api_url = f"http://127.0.0.1:{port}/api"
        spec = importlib.util.find_spec("prefect")
        assert spec is not None and spec.origin is not None, "prefect is not installed"
        app_dir = Path(spec.origin).parent.parent  # what Prefect passes to uvicorn
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
             "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        atexit.register(self.stop)
        logging.getLogger("flows.server").info("Starting temporary server on %s (Prefect's ephemeral mode; "
                                               "`align server start` keeps one running)", self.api_url)
        return self.api_url

    def wait(self, timeout: float = 120) -> str:
        """The API URL once the server answers; RuntimeError if it exits or stays silent for `timeout` s."""
        assert self.proc is not None, "start() first"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Prefect's temporary server exited with code {self.proc.returncode} before it "
                                   "answered; run `align server start` to see its log, or set PREFECT_API_URL")
            if _healthy(self.api_url, timeout=0.5):
                return self.api_url
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Prefect's temporary server did not answer within {timeout:.0f} s at {self.api_url}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
