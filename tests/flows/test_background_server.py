"""`align server start` leaves a real Prefect server on 127.0.0.1 that `align run` then reuses."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import STAGE_ORDER, write_params
from tests.flows.test_server import free_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def test_start_reuse_stop(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_LOGGING_LEVEL": "INFO"}
    env.pop("PREFECT_API_URL", None)
    write_params(tmp_path)

    def align(*args):
        res = subprocess.run([str(BIN / "align"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout + res.stderr

    port = free_port()
    try:
        assert f"http://127.0.0.1:{port}" in align("server", "start", "--port", str(port))
        assert f"http://127.0.0.1:{port}" in align("server", "start")  # idempotent: finds the running one
        out = align("run")
        assert "Starting temporary server" not in out  # no ephemeral server: the background one was used
        assert out.count(" executed ") == len(STAGE_ORDER)
    finally:
        align("server", "stop")
    out = align("run")
    assert "Starting temporary server" in out and out.count(" cached ") == len(STAGE_ORDER)
