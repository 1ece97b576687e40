"""What the fault-injection campaign (benchmarks/faults.py) found, pinned: a full disk met by torch.save or
safetensors (which raise no OSError) is reported with the folder and the bytes; a changed byte in a manifest
is caught by the manifest's own hash; a cached rerun records in dvc.lock what a killed run built."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from stages.harness import artifacts, runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params


@contextlib.contextmanager
def tmpfs(folder: Path, size: int):
    """A tmpfs of `size` bytes at `folder` (root only: the test is skipped elsewhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_torch_and_safetensors_writes_on_a_full_device_count_as_disk_full(tmp_path):
    import torch
    from safetensors.torch import save_file

    with tmpfs(tmp_path / "small", 4 << 20) as folder:
        weights = {"w": torch.zeros(2 << 20)}  # 8 MiB
        errors = []
        for save in (lambda: torch.save(weights, folder / "a.pt"), lambda: save_file(weights, folder / "b.st")):
            with pytest.raises(Exception) as e:
                save()
            assert not isinstance(e.value, OSError)  # why `is_disk_full` cannot go by errno alone
            errors.append(e.value)
        assert all(artifacts.is_disk_full(e, folder) for e in errors)
    assert not artifacts.is_disk_full(RuntimeError("unexpected pos 576 vs 534"), tmp_path)  # room left: not it


@pytest.mark.slow
def test_full_disk_in_a_training_stage_names_the_folder_and_the_bytes(tmp_path, built_pipeline):
    """sft's rebuild on a device with half the room its output needs: StageFailed with the folder and the bytes
    it needed, the previous version in place, no temporary folder; with room again, the rerun finishes."""
    params, _ = built_pipeline
    need = artifacts.folder_bytes(Path(params.run.output_dir) / "sft")
    with tmpfs(tmp_path / "artifacts", 1 << 30) as out:
        shutil.copytree(params.run.output_dir, out, dirs_exist_ok=True)
        used = shutil.disk_usage(out).used
        subprocess.run(["mount", "-o", f"remount,size={used + need // 2}", str(out)], check=True)
        mine = load_params(write_params(tmp_path, {"sft": {"learning_rate": params.sft.learning_rate * 3}}))
        before = (out / "sft" / "manifest.json").read_bytes()
        with pytest.raises(runner.StageFailed) as e:
            runner.run_stage("sft", mine)
        message = str(e.value)
        assert f"while writing {out / 'sft'}: it needs at least" in message and " bytes " in message, message
        needed = int(message.split("needs at least ")[1].split(" bytes")[0].replace(",", ""))
        assert needed >= need, message  # at least the previous version's size
        assert "previous output, if any, is intact" in message
        assert (out / "sft" / "manifest.json").read_bytes() == before and artifacts.verify(out / "sft")[0]
        assert not list(out.glob(".tmp-*"))
        subprocess.run(["mount", "-o", "remount,size=1g", str(out)], check=True)
        assert runner.run_stage("sft", mine)["executed"] is True
        assert runner.inspect("sft", mine).current and not list((out / ".work").glob("sft-*"))


def test_a_changed_byte_in_a_manifest_is_caught_by_its_own_hash(tmp_path):
    final = tmp_path / "out"
    with artifacts.atomic_output(final) as tmp:
        (tmp / "a.txt").write_text("v1")
        artifacts.write_manifest(tmp, {"fingerprint": "f", "wall_time_s": 1.25})
    assert artifacts.verify(final, "f") == (True, "")
    path = final / artifacts.MANIFEST
    path.write_text(path.read_text().replace('"wall_time_s": 1.25', '"wall_time_s": 1.35'))  # still valid JSON
    ok, why = artifacts.verify(final, "f")
    assert not ok and f"{path} was changed since it was written" in why
    m = json.loads(path.read_text())
    m.pop("manifest_hash")  # a manifest written before the seal existed still verifies by its files
    path.write_text(json.dumps(m))
    assert artifacts.verify(final, "f") == (True, "")


def test_dvc_lock_behind_the_outputs_is_recorded_by_a_cached_rerun(tmp_path):
    from flows.dvc_sync import lock_behind

    (tmp_path / "artifacts" / "sft").mkdir(parents=True)
    manifest = tmp_path / "artifacts" / "sft" / artifacts.MANIFEST
    manifest.write_text("{}")
    assert lock_behind(tmp_path, str(tmp_path / "artifacts"))  # no dvc.lock
    lock = tmp_path / "dvc.lock"
    lock.write_text("schema: '2.0'\nstages: {}\n")
    assert not lock_behind(tmp_path, str(tmp_path / "artifacts"))
    later = time.time() + 5
    os.utime(manifest, (later, later))  # a stage published after the last commit (that run was killed)
    assert lock_behind(tmp_path, str(tmp_path / "artifacts"))
    os.utime(lock, (later + 5, later + 5))
    assert not lock_behind(tmp_path, str(tmp_path / "artifacts"))
    promote = tmp_path / "artifacts" / "promote" / artifacts.MANIFEST  # not a dvc.yaml stage: never behind for it
    promote.parent.mkdir()
    promote.write_text("{}")
    os.utime(promote, (later + 10, later + 10))
    assert not lock_behind(tmp_path, str(tmp_path / "artifacts"))
    lock.write_text("schema: '2.0'\nstages:\n  sft: {cmd: [")  # a commit killed while writing it
    os.utime(lock, (later + 5, later + 5))
    assert lock_behind(tmp_path, str(tmp_path / "artifacts"))


def test_runs_finishing_together_commit_dvc_lock_once(tmp_path, monkeypatch):
    """Four runs of one checkout reach their commit at once: they take turns, the first records the outputs and
    the others find dvc.lock already recording them (DVC itself would refuse a second concurrent writer)."""
    import threading

    from flows import dvc_sync

    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    (tmp_path / "artifacts" / "sft").mkdir(parents=True)
    (tmp_path / "artifacts" / "sft" / artifacts.MANIFEST).write_text("{}")
    inside, commits = [], []

    def commit_lock(root):  # what `dvc commit --force` does to dvc.lock, and whether two ran at once
        inside.append(1)
        assert len(inside) == 1, "two commits at once"
        time.sleep(0.2)
        (root / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
        commits.append(1)
        inside.pop()
        return True, "recorded"

    monkeypatch.setattr(dvc_sync, "commit_lock", commit_lock)
    results = []
    def run():
        results.append(dvc_sync.commit_once(tmp_path, str(tmp_path / "artifacts")))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(commits) == 1 and sorted(results) == [(True, "dvc.lock already records these outputs (committed by a "
                                                     "concurrent run)")] * 3 + [(True, "recorded")]


def test_a_prefect_server_gone_mid_run_is_named_in_the_last_line(monkeypatch):
    """What the flow raises when its server dies (the campaign's server-death fault: httpx's ConnectError from the
    task engine) becomes a line that says so and what to do; other errors keep their own line."""
    import httpx

    from flows.cli import server_lost

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    try:
        try:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        except httpx.ConnectError as e:
            raise RuntimeError("Task run encountered an exception") from e
    except RuntimeError as e:
        line = server_lost(e)
    assert line.startswith("the Prefect server at http://127.0.0.1:4200/api stopped answering during the run "
                           "(ConnectError: [Errno 111] Connection refused)") and "align server start" in line
    assert server_lost(ValueError("sft.learning_rate = -1: must be > 0")) is None


def test_a_server_restarted_after_a_crash_gets_its_port_back():
    """A server that dies leaves its accepted connections in TIME_WAIT for a minute; `align server start` must
    still take the same port (uvicorn binds with SO_REUSEADDR), or a flow run in progress keeps calling the old
    address while the server answers at another."""
    import socket

    from flows.server import _free_port

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    server.close()
    assert _free_port(port) == port
    with socket.socket() as busy:  # a port a live server listens on is still refused
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert _free_port(busy.getsockname()[1]) != busy.getsockname()[1]


@pytest.mark.slow
def test_a_run_killed_after_its_last_checkpoint_resumes_to_the_same_bytes(tmp_path, built_pipeline, monkeypatch):
    """The campaign's kill in sft's manifest write: training had finished and saved checkpoint-N at max_steps = N.
    Resumed from there, transformers trained step N+1 (its stop check follows a step): one more loss in the log
    and the curves, and with a constant learning rate other weights. The rerun goes back one checkpoint."""
    import stages.pipeline.training as training

    params, _ = built_pipeline
    section = {"sft": {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "lr_scheduler_type": "constant"}}
    runs = {}
    for name in ("clean", "crashed"):
        (tmp_path / name).mkdir()
        runs[name] = load_params(write_params(tmp_path / name, section))
        shutil.copytree(Path(params.run.output_dir) / "preprocess", Path(runs[name].run.output_dir) / "preprocess")
    clean = runner.run_stage("sft", runs["clean"])

    def crash(*args, **kwargs):
        raise RuntimeError("killed after the last checkpoint")

    with monkeypatch.context() as m:
        m.setattr(training, "save_outputs", crash)
        with pytest.raises(RuntimeError, match="killed after the last checkpoint"):
            runner.run_stage("sft", runs["crashed"])
    work = Path(runs["crashed"].run.output_dir) / ".work"
    assert sorted(p.name for p in work.glob("sft-*/checkpoints/checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = runner.run_stage("sft", runs["crashed"])
    history = [json.loads((Path(r.run.output_dir) / "sft" / "log_history.json").read_text()) for r in runs.values()]
    losses = [[(h["step"], h["loss"]) for h in hist if "loss" in h] for hist in history]
    assert losses[0] == losses[1] and [s for s, _ in losses[1]] == [1, 2, 3, 4]
    assert resumed["outputs"]["files"] == clean["outputs"]["files"]  # the same weights, byte for byte
    assert resumed["metrics"]["steps"] == clean["metrics"]["steps"] == 4
    assert resumed["metrics"]["resumed_from"].endswith("checkpoint-2")
