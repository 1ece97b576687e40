"""Artifacts beyond one machine: stage outputs pushed to a DVC remote by one checkout are pulled by another.

A local directory stands in for the remote; S3 / GCS / SSH remotes differ only in the URL
(`dvc remote add -d store s3://bucket/align`, see README "Scale out").
"""
import subprocess
import sys

import pytest

from stages.harness import artifacts
from tests.test_dvc import dvc_repo, sh  # noqa: F401  (the fixture: a git + DVC checkout of the project)

pytestmark = pytest.mark.slow


def status(repo) -> dict[str, str]:
    out = sh(sys.executable, "-m", "stages", "status", cwd=repo).stdout
    return {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.strip()}


def test_push_wipe_pull_round_trip(dvc_repo, tmp_path):  # noqa: F811
    repo, remote = dvc_repo, tmp_path / "remote"
    sh("dvc", "repro", "sft", cwd=repo)  # preprocess and sft
    sh("dvc", "remote", "add", "-d", "store", str(remote), cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "sft built", cwd=repo)
    sh("dvc", "push", cwd=repo)
    assert any(p.is_file() for p in remote.rglob("*")), "nothing was pushed"
    hashes = {s: artifacts.read_manifest(repo / "artifacts" / s)["outputs"]["hash"] for s in ("preprocess", "sft")}

    # another machine: a fresh clone, no DVC cache, no outputs
    other = tmp_path / "other"
    sh("git", "clone", "-q", str(repo), str(other), cwd=tmp_path)
    assert not (other / "artifacts" / "sft").exists()
    assert "stale" in status(other)["preprocess"]
    pulled = sh("dvc", "pull", "preprocess", "sft", cwd=other)
    assert pulled.returncode == 0
    rows = status(other)
    assert rows["preprocess"] == "current" and rows["sft"] == "current", rows
    for stage, h in hashes.items():
        ok, why = artifacts.verify(other / "artifacts" / stage)
        assert ok, why
        assert artifacts.read_manifest(other / "artifacts" / stage)["outputs"]["hash"] == h
    assert (other / "artifacts" / "sft" / "model" / "model.safetensors").is_file()

    # and the same checkout, its cache and outputs wiped
    for path in (repo / ".dvc" / "cache", repo / "artifacts" / "sft", repo / "artifacts" / "preprocess"):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    assert "stale" in status(repo)["sft"]
    sh("dvc", "pull", "preprocess", "sft", cwd=repo)
    assert status(repo)["sft"] == "current"
