"""Stage evaluate with lm-eval tasks, and the completions table: in report.md and in the trackers."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stages import trackers
from stages.data import read_jsonl
from stages.harness import runner
from stages.pipeline.evaluate import completions_table


def copy_of(built_pipeline, tmp_path, **evaluate):
    params, _ = built_pipeline
    out = tmp_path / "artifacts"
    shutil.copytree(params.run.output_dir, out, symlinks=True)  # the session's pipeline stays as it is
    shutil.rmtree(out / "evaluate")
    return dataclasses.replace(params, run=dataclasses.replace(params.run, output_dir=str(out)),
                               evaluate=dataclasses.replace(params.evaluate, **evaluate))


@pytest.mark.slow
def test_lm_eval_columns_for_every_model(built_pipeline, tmp_path, monkeypatch):
    """align_arithmetic on base, sft, policy (the adapter on SFT, through lm-eval's peft) and merged; the merged
    model scores what the unmerged policy scores; the task file is kept for the CLI."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("lm_eval")
    params, _ = built_pipeline
    le = dataclasses.replace(params.evaluate.lm_eval, tasks=["align_arithmetic"], limit=8, batch_size=8)
    p = copy_of(built_pipeline, tmp_path, lm_eval=le, log_completions=5)
    m = runner.run_stage("evaluate", p)
    table = {r["model"]: r for r in m["metrics"]["table"]}
    col = "lm_eval.align_arithmetic.exact_match"
    assert set(table) == {"base", "sft", "policy", "merged"} and all(col in r for r in table.values())
    assert table["policy"][col] == table["merged"][col]
    assert m["metrics"]["timings"]["lm_eval_s"] > 0
    out = runner.output_dir(p, "evaluate")
    assert (out / "lm_eval_tasks" / "align_arithmetic.yaml").is_file()
    report = (out / "report.md").read_text()
    assert col in report and "## Completions" in report
    flat = json.loads(runner.metrics_path(p, "evaluate").read_text())  # what `dvc metrics show` reads
    assert flat[f"models.merged.{col}"] == table["merged"][col]
    rows = read_jsonl(out / "completions.jsonl")
    assert len(rows) == 5 and {"prompt", "reference", "base completion", "merged completion", "merged correct"} <= \
        set(rows[0])


def test_completions_table_rows():
    preds = [{"model": m, "prompt": [{"role": "user", "content": f"{i}+1"}], "reference": str(i + 1),
              "completion": f"{m}{i}", "length": 2, "correct": m == "sft", "reward": 0.5 * i}
             for m in ("sft", "merged") for i in range(3)]
    preds[3]["judge"] = 1.0  # merged, prompt 0
    rows = completions_table(preds, ["sft", "merged"], 2)
    assert rows == [
        {"prompt": "0+1", "reference": "1", "sft completion": "sft0", "sft reward": 0.0, "sft correct": True,
         "merged completion": "merged0", "merged reward": 0.0, "merged judge": 1.0, "merged correct": False},
        {"prompt": "1+1", "reference": "2", "sft completion": "sft1", "sft reward": 0.5, "sft correct": True,
         "merged completion": "merged1", "merged reward": 0.5, "merged correct": False}]


@pytest.fixture
def mlflow_uri(tmp_path):
    """A real `mlflow server` (sqlite store, local artifacts) on a free port of 127.0.0.1, killed afterwards. In a
    process of its own: MLflow's sqlite store configures logging when it opens, which closes pytest's captured
    streams when run inside the test process."""
    import signal
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri",
                               f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root",
                               str(tmp_path / "mlflow-artifacts")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


@pytest.mark.slow
def test_completions_table_reaches_mlflow_tensorboard_and_dvclive(tmp_path, monkeypatch, mlflow_uri):
    """trackers.log_table into a real MLflow tracking server, TensorBoard's event file and DVCLive: each holds
    the same rows."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("dvclive")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stages.harness.params_loader import load_params
    from tests.conftest import write_params

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "align-table-test")
    monkeypatch.setenv(trackers.RUN_ENV, "align-table-test")
    rows = [{"prompt": "12+34", "reference": "46", "sft completion": "4|6\nok", "sft correct": False,
             "merged completion": "46", "merged reward": 0.25, "merged judge": 0.75, "merged correct": True},
            {"prompt": "1+2", "reference": "3", "sft completion": "3", "sft correct": True,
             "merged completion": "3", "merged reward": None, "merged judge": 0.5, "merged correct": True}]
    params_file = write_params(tmp_path, {"run": {"report_to": ["mlflow", "tensorboard", "dvclive"]}})
    # in a process of its own, as the stage runs: the trackers' libraries reconfigure logging and streams
    # in ways that break pytest's capture after other tests of the session
    script = ("import json, sys; from stages import trackers; from stages.harness.params_loader import load_params; "
              "from pathlib import Path; p = load_params(sys.argv[1]); print(json.dumps(trackers.log_table("
              "p, 'evaluate', 'completions', json.loads(sys.argv[2]), folder=Path(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", script, str(params_file), json.dumps(rows), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])
    p = load_params(params_file)
    assert written == ["mlflow", "dvclive", "tensorboard"]

    _, parent = trackers.mlflow_parent(p)
    # the artifact MLflow's UI reads, in the run's (local) artifact store
    from urllib.parse import urlparse

    store = Path(urlparse(mlflow.MlflowClient().get_run(parent).info.artifact_uri).path)
    got = json.loads((store / "evaluate" / "completions.json").read_text())
    assert got["columns"] == list(rows[0])
    table = [dict(zip(got["columns"], row, strict=True)) for row in got["data"]]
    assert [r["sft completion"] for r in table] == ["4|6\nok", "3"] and [r["merged reward"] for r in table] == \
        [0.25, ""]

    live = json.loads((tmp_path / "out" / "dvclive" / "completions.json").read_text())
    assert [r["merged judge"] for r in live] == [0.75, 0.5]

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [tag] = events.Tags()["tensors"]
    text = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "| 12+34 | 46 | 4\\|6<br>ok |" in text and "| merged judge |" in text
