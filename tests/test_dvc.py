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


def sh(*cmd, cwd, check=True):
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture
def dvc_repo(tmp_path):
    """A fresh git + DVC checkout of the project's stages, dvc.yaml and (small) params.yaml."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    params = write_params(repo)
    text = params.read_text().replace(str(repo / "artifacts"), "artifacts")  # dvc.yaml's relative output_dir
    params.write_text(text)
    sh("git", "init", "-q", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    sh("dvc", "config", "core.analytics", "false", cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init", cwd=repo)
    return repo


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
