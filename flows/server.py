"""A local Prefect server for `align run`, started once in the background and reused.

Prefect's ephemeral mode starts and stops a temporary server on every run (about 6-9 s on
2 cores), and its UI is gone when the run ends. `align server start` starts
`prefect server start --host 127.0.0.1` in the background instead and records its address
in `$PREFECT_HOME/align-server.json`; `align run` uses it whenever PREFECT_API_URL is unset
and it answers. `make run` starts it, so the runs, logs and artifacts stay browsable at the
printed address. `align server stop` stops it.
"""
from __future__ import annotations

import json
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
