"""`dvc repro` in a real git repository agrees with the stage manifests and with the Prefect flow."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from stages.dvcgen import render_dvc_yaml
from tests.conftest import ROOT, STAGE_ORDER, write_params

pytestmark = pytest.mark.slow


def test_committed_dvc_yaml_is_generated_from_registry():
    assert (ROOT / "dvc.yaml").read_text() == render_dvc_yaml(), "run: python -m stages dvc-yaml > dvc.yaml"


def bin_path(path: str = os.environ["PATH"]) -> str:
    """PATH with this interpreter's bin folder first (what `. .venv/bin/activate` does)."""
    return f"{os.path.dirname(sys.executable)}:{path}"


def sh(*cmd, cwd, check=True, path=None):
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": path or bin_path()}
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # 20 s is short on a loaded machine
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def commit(repo, message):
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", message, cwd=repo)


def make_dvc_repo(repo):
    """A fresh git + DVC checkout of the project's stages, dvc.yaml, DVC config and (small) params.yaml."""
    repo.mkdir()
    shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    params = write_params(repo)
    text = params.read_text().replace(str(repo / "artifacts"), "artifacts")  # dvc.yaml's relative output_dir
    params.write_text(text)
    sh("git", "init", "-q", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")  # analytics off, the offline plots page
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    commit(repo, "init")
    return repo


@pytest.fixture
def dvc_repo(tmp_path):
    return make_dvc_repo(tmp_path / "repo")


def set_param(repo, old, new):
    path = repo / "params.yaml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def ran(output: str) -> list[str]:
    return [s for s in STAGE_ORDER if f"Running stage '{s}'" in output]


def test_repro_noop_partial_rerun_and_agreement_with_prefect(dvc_repo):
    assert ran(sh("dvc", "repro", cwd=dvc_repo).stdout) == list(STAGE_ORDER)
    metrics = json.loads((dvc_repo / "artifacts" / "metrics" / "evaluate.json").read_text())
    assert 0 <= metrics["accuracy"] <= 1

    t0 = time.perf_counter()
    again = sh("dvc", "repro", cwd=dvc_repo).stdout
    print(f"dvc repro no-op: {time.perf_counter() - t0:.2f}s")
    assert ran(again) == [], again
    status = sh(sys.executable, "-m", "stages", "status", cwd=dvc_repo).stdout
    assert status.count("current") == len(STAGE_ORDER), status  # the manifests agree with DVC

    set_param(dvc_repo, "max_new_tokens: 4", "max_new_tokens: 5")
    assert ran(sh("dvc", "repro", cwd=dvc_repo).stdout) == ["evaluate"]
    set_param(dvc_repo, "max_new_tokens: 5", "max_new_tokens: 4")
    assert ran(sh("dvc", "repro", cwd=dvc_repo).stdout) == []  # restored from DVC's run-cache
    status = sh(sys.executable, "-m", "stages", "status", cwd=dvc_repo).stdout
    assert status.count("current") == len(STAGE_ORDER), status  # ... and the restored files verify against their manifest

    # the Prefect path sees the same state: everything cached
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=dvc_repo).stdout
    assert flow.count(" cached ") == len(STAGE_ORDER), flow
    # a param change through the flow: sft and evaluate execute, and dvc.lock records them
    set_param(dvc_repo, "learning_rate: 0.003", "learning_rate: 0.004")
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=dvc_repo).stdout
    rows = [line.split()[:2] for line in flow.splitlines()]
    assert [r for r in rows if len(r) == 2 and r[1] in ("cached", "executed")] == [
        ["preprocess", "cached"], *([s, "executed"] for s in STAGE_ORDER[1:])], flow
    assert "changed" not in sh("dvc", "status", cwd=dvc_repo).stdout
    assert ran(sh("dvc", "repro", cwd=dvc_repo).stdout) == []


def without_venv(path: str = os.environ["PATH"]) -> str:
    """PATH without this interpreter's bin folder: `make run` runs `.venv/bin/align` with the venv inactive."""
    here = os.path.realpath(os.path.dirname(sys.executable))
    return ":".join(p for p in path.split(":") if p and os.path.realpath(p) != here)


def test_flow_keeps_dvc_lock_in_step_without_dvc_on_path(dvc_repo):
    """What `make run` then the README's DVC section do: the flow (dvc not on PATH) records dvc.lock, so
    `dvc status` is clean and `dvc repro` runs nothing; a missing or unrecordable lock is reported."""
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=dvc_repo, path=without_venv())
    assert (dvc_repo / "dvc.lock").is_file(), flow.stdout + flow.stderr
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=dvc_repo).stdout
    t0 = time.perf_counter()
    again = sh("dvc", "repro", cwd=dvc_repo).stdout
    print(f"dvc repro right after the flow: {time.perf_counter() - t0:.2f}s")
    assert ran(again) == [], again
    status = sh(sys.executable, "-m", "flows.cli", "status", cwd=dvc_repo).stdout.splitlines()
    assert status[-1].startswith("dvc.lock     in step"), status

    # a lost lock: `align status` says so and how to fix it; the next (all cached) run records it again
    (dvc_repo / "dvc.lock").unlink()
    status = sh(sys.executable, "-m", "flows.cli", "status", cwd=dvc_repo, path=without_venv()).stdout
    assert "dvc.lock     missing" in status and "-m dvc commit --force" in status, status
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=dvc_repo, path=without_venv())
    assert flow.stdout.count(" cached ") == len(STAGE_ORDER), flow.stdout
    assert (dvc_repo / "dvc.lock").is_file(), flow.stdout + flow.stderr
    assert ran(sh("dvc", "repro", cwd=dvc_repo).stdout) == []

    # DVC cannot record it (a broken .dvc/config): the run still succeeds, and its log says why, loudly
    (dvc_repo / "dvc.lock").unlink()
    config = dvc_repo / ".dvc" / "config"
    config.write_text(config.read_text() + "[no_such_section]\n    x = 1\n")
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=dvc_repo, path=without_venv())
    log = flow.stdout + flow.stderr
    assert "WARNING" in log and "dvc.lock not updated" in log and "no_such_section" in log, log
    assert not (dvc_repo / "dvc.lock").exists()


def test_sync_says_why_it_cannot_record(tmp_path, monkeypatch):
    from flows import dvc_sync

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    params = str(tmp_path / "params.yaml")
    out = str(tmp_path / "artifacts")
    assert dvc_sync.why_not_recorded(params, out, []) == (
        "warning", f"dvc.lock not updated: {tmp_path} has dvc.yaml but no .dvc/ folder; run `dvc init` there")
    (tmp_path / ".dvc").mkdir()
    assert dvc_sync.why_not_recorded(params, out, []) is None
    level, why = dvc_sync.why_not_recorded(params, out, ["sft.learning_rate=1e-3"])
    assert level == "info" and "sft.learning_rate=1e-3" in why
    level, why = dvc_sync.why_not_recorded(params, str(tmp_path / "elsewhere"), [])
    assert level == "info" and "run.output_dir" in why
    monkeypatch.setitem(sys.modules, "dvc", None)  # as if dvc were not installed in this environment
    level, why = dvc_sync.why_not_recorded(params, out, [])
    assert level == "warning" and f"dvc is not installed for {sys.executable}" in why
    assert dvc_sync.lock_status(tmp_path).startswith("dvc.lock     unknown: dvc is not installed")
