"""Never-corrupt artifacts and concurrent runs: a damaged artifact is rebuilt with a warning naming it, a full
disk leaves the previous version intact, one writer per output folder, runs with other params stay apart."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stages.harness import artifacts, runner
from stages.harness.params_loader import load_params
from tests.conftest import ROOT, write_params


@pytest.fixture
def pipeline_copy(tmp_path, built_pipeline):
    """Params whose output folder is a private copy of the built small pipeline."""
    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")
    return load_params(write_params(tmp_path))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_row(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    row = json.loads(lines[0])
    row["completion"] = [{"role": "assistant", "content": "tampered"}]
    path.write_text(json.dumps(row) + "\n" + "".join(lines[1:]))


def _edit_manifest(path: Path) -> None:
    m = json.loads(path.read_text())
    m["outputs"]["files"]["pairs.jsonl"] = "0" * 64
    path.write_text(json.dumps(m))


# (stage, damaged file, damage, what the warning must name)
DAMAGE = [
    ("sft", "model/model.safetensors", _truncate, r"model/model\.safetensors"),
    ("preprocess", "sft_train.jsonl", _edit_row, r"sft_train\.jsonl"),
    ("sft", "model/tokenizer.json", Path.unlink, r"model/tokenizer\.json"),
    ("reference", "manifest.json", _edit_manifest, r"manifest\.json was changed since it was written"),
    ("score", "manifest.json", lambda p: p.write_text('{"stage": "score", '),
     r"manifest\.json is missing or unreadable"),
]


@pytest.mark.parametrize("stage, name, damage, named", DAMAGE, ids=[f"{d[0]}:{d[1]}" for d in DAMAGE])
def test_damaged_artifact_is_rebuilt_with_a_warning(pipeline_copy, caplog, stage, name, damage, named):
    folder = runner.output_dir(pipeline_copy, stage)
    before = artifacts.read_manifest(folder)
    damage(folder / name)
    state = runner.inspect(stage, pipeline_copy)
    assert not state.current
    with caplog.at_level(logging.WARNING, logger="stages"):
        m = runner.run_stage(stage, pipeline_copy)
    assert m["executed"] is True
    warning = [r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING and "rebuilding" in r.getMessage()]
    assert warning and str(folder) in warning[0], caplog.text
    assert re.search(named, warning[0]), warning[0]
    assert artifacts.verify(folder, m["fingerprint"]) == (True, "")
    if stage == "preprocess":  # deterministic rebuild: same content, so everything downstream stays current
        assert m["outputs"]["hash"] == before["outputs"]["hash"]
        assert runner.inspect("sft", pipeline_copy).current


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_full_disk_fails_cleanly_and_keeps_the_previous_version(pipeline_copy, monkeypatch, capsys, where):
    import stages.pipeline.preprocess as preprocess
    from stages.__main__ import main

    folder = runner.output_dir(pipeline_copy, "preprocess")
    before = (folder / "manifest.json").read_bytes()

    def disk_full(path, *args, **kwargs):
        Path(path).write_text('{"half": ')
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    if where == "data":
        monkeypatch.setattr(preprocess, "write_jsonl", disk_full)
    else:
        monkeypatch.setattr(artifacts, "write_manifest", lambda folder, m: disk_full(folder / ".manifest.json.tmp"))
    with pytest.raises(runner.StageFailed, match=r"preprocess: no space left on device while writing .*previous "
                                                 r"output, if any, is intact"):
        runner.run_stage("preprocess", pipeline_copy, force=True)
    assert (folder / "manifest.json").read_bytes() == before
    assert artifacts.verify(folder) == (True, "")
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    params_file = Path(pipeline_copy.run.output_dir).parent / "params.yaml"
    assert main(["preprocess", "--params", str(params_file), "--force"]) == 5
    assert "no space left on device" in capsys.readouterr().err
    assert artifacts.verify(folder) == (True, "")


def test_leftovers_of_a_killed_writer_are_cleaned_and_a_half_renamed_version_restored(tmp_path):
    final = tmp_path / "out"
    with artifacts.atomic_output(final) as tmp:
        (tmp / "a.txt").write_text("v1")
        artifacts.write_manifest(tmp, {"fingerprint": "v1"})
    os.replace(final, tmp_path / ".old-out-1234abcd")  # killed between "move the old aside" and "move the new in"
    (tmp_path / ".tmp-out-deadbeef").mkdir()  # killed while writing
    (tmp_path / ".tmp-out-deadbeef" / "half.bin").write_bytes(b"\0")
    with artifacts.lock(final):
        artifacts.clean_leftovers(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "out"]
    assert artifacts.verify(final, "v1") == (True, "")


def test_identical_runs_do_the_work_once(tmp_path, monkeypatch):
    """Two runs of the same stage with identical params at once: one builds, the other waits for the lock and
    then finds the output current."""
    params = load_params(write_params(tmp_path))
    calls = []

    def slow_stage(ctx):
        calls.append(threading.current_thread().name)
        time.sleep(1.0)
        (ctx.out / "rows.jsonl").write_text("{}\n")
        return {"rows": 1}

    monkeypatch.setattr(runner, "resolve", lambda target: slow_stage)
    results = {}

    def run(name):
        results[name] = runner.run_stage("preprocess", params)

    threads = [threading.Thread(target=run, args=(f"run{i}",), name=f"run{i}") for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(30)
    assert len(calls) == 1
    assert sorted(r["executed"] for r in results.values()) == [False, True]
    assert results["run0"]["fingerprint"] == results["run1"]["fingerprint"]


def test_other_params_in_a_shared_output_dir_are_refused_not_mixed(pipeline_copy):
    """A run whose upstream folder was rebuilt by a run with other params must not build on it silently."""
    other = load_params(write_params(Path(pipeline_copy.run.output_dir).parent,
                                     {"data": {"builtin": {"seed": 7}}}))
    runner.run_stage("preprocess", other)  # the other run replaces preprocess in the shared folder
    with pytest.raises(runner.UpstreamMissing, match=r"needs the output of 'preprocess' .* built with other params"):
        runner.inspect("sft", pipeline_copy)
    with pytest.raises(runner.UpstreamMissing, match=r"needs the output of 'sft' .* built with other params"):
        runner.inspect("reward", other)  # sft was built from the first run's preprocess


@pytest.mark.slow
def test_concurrent_runs(tmp_path):
    """Two `python -m stages preprocess` processes with identical params at once (one builds, the other waits and
    reuses it) while this process runs preprocess with other params into its own output folder: every run
    completes, the two outputs are distinct and each is correct for its params."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    same = write_params(tmp_path / "a")
    other = load_params(write_params(tmp_path / "b", {"data": {"builtin": {"seed": 7}}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "stages", "preprocess", "--params", str(same)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    mb = runner.run_stage("preprocess", other)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert sorted(json.loads(o[0])["executed"] for o in outs) == [False, True]
    a = load_params(same)
    ma = artifacts.read_manifest(runner.output_dir(a, "preprocess"))
    assert runner.inspect("preprocess", a).current and runner.inspect("preprocess", other).current
    assert ma["params"]["data"]["builtin"]["seed"] == 0 and mb["params"]["data"]["builtin"]["seed"] == 7
    assert ma["outputs"]["hash"] != mb["outputs"]["hash"]
    assert not list((tmp_path / "a" / "artifacts").rglob(".tmp-*"))


def test_nightly_deployment_runs_one_at_a_time(tmp_path):
    from flows.deploy import build_deployments

    full, nightly = build_deployments(str(write_params(tmp_path)))
    assert nightly.name == "nightly" and nightly.concurrency_limit == 1
