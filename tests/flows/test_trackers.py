"""Trackers of a pipeline run (stages/trackers.py) against a real MLflow tracking server on 127.0.0.1, and W&B
in offline mode.

The flow runs the small pipeline with `run.report_to: [tensorboard, mlflow, wandb]`; the runs are read
back through MLflow's own client: one parent run named after the flow run, holding the resolved
params and the score/evaluate metrics, and one nested run per training stage with its curves. W&B's
offline run files are read back record by record: a run per training stage and one for the
score/evaluate metrics, all in the group of the flow run.
"""
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stages.harness.params_loader import load_params
from stages.harness.runner import output_dir
from tests.conftest import write_params

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")
WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` with a sqlite store on a free port of 127.0.0.1; stopped after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "mlflow-server.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                               "--default-artifact-root", str(tmp_path / "mlflow-artifacts")],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not start: "
                                       f"{(tmp_path / 'mlflow-server.log').read_text()}") from None
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def wandb_runs(folder: Path) -> dict[str, dict]:
    """{run name: {"group", "project", "history": {key: [values]}, "summary": {key: value}}} of the offline runs
    W&B wrote under `folder`, read from their `.wandb` files: W&B's record log (a ":W&B" file header, then
    32 KiB blocks of chunks, each with a <crc32, length, type> header) of `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = {}
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk, run = path.read_bytes(), 7, b"", None
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if left < 7 or (length, kind) == (0, 0):  # the rest of a block is padding
                pos += left
                continue
            body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            chunk = body if kind in (1, 2) else chunk + body  # FULL, FIRST | MIDDLE, LAST
            if kind not in (1, 4):
                continue
            record = pb.Record()
            record.ParseFromString(chunk)
            which = record.WhichOneof("record_type")
            if which == "run":
                run = runs.setdefault(record.run.display_name, {"group": record.run.run_group,
                                                                "project": record.run.project,
                                                                "history": {}, "summary": {}})
            elif which == "history" and run is not None:
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    run["history"].setdefault(key, []).append(json.loads(item.value_json))
            elif which == "summary" and run is not None:
                run["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in record.summary.update})
    return runs


def run_tree(client, experiment_id: str) -> str:
    """The experiment's runs as MLflow's client returns them: parents, their children, params and metrics."""
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time ASC"])
    lines = []
    for parent in (r for r in runs if "mlflow.parentRunId" not in r.data.tags):
        lines.append(f"{parent.info.run_name}  [{parent.info.status}, {len(parent.data.params)} params]")
        lines += [f"    param {k} = {parent.data.params[k]}" for k in
                  ("sft.learning_rate", "policy.method", "policy.dpo.beta", "run.report_to") if k in parent.data.params]
        lines += [f"    metric {k} = {v:.4g}" for k, v in sorted(parent.data.metrics.items())
                  if k.startswith("score.") or k.startswith("evaluate.models.merged") or k == "evaluate.accuracy"]
        for child in (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id):
            loss = client.get_metric_history(child.info.run_id, "loss")
            lines.append(f"  └─ {child.info.run_name}  [{child.info.status}, {len(child.data.params)} params, "
                         f"loss at steps {[m.step for m in loss]}]")
            stage = child.data.tags["align.stage"]
            lines += [f"       param {k} = {child.data.params[k]}" for k in
                      ("learning_rate", "logging_steps", "run_name", f"{stage}.learning_rate",
                       "policy.dpo.learning_rate")
                      if k in child.data.params]
            lines += [f"       metric {k} = {v:.4g}" for k, v in sorted(child.data.metrics.items())
                      if k in ("loss", "train_loss", "eval_loss", "rewards/accuracies", "accuracy")]
    return "\n".join(lines)


def test_pipeline_run_is_one_parent_with_a_nested_run_per_training_stage(tmp_path, prefect_server, mlflow_server,
                                                                          monkeypatch):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from flows.align import align
    from stages.trackers import RUN_ENV, sections

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "align-test")
    monkeypatch.delenv(RUN_ENV, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    report_to = ["tensorboard", "mlflow", *(["wandb"] if WANDB else [])]
    params_file = write_params(tmp_path, {"run": {"report_to": report_to}})
    state = align(params_file=str(params_file), return_state=True)
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(state.state_details.flow_run_id).name
    assert RUN_ENV not in os.environ  # the flow's name for its stages does not outlive it

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("align-test")
    tree = run_tree(client, experiment.experiment_id)
    print(tree)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [p.info.run_name for p in parents] == [f"align-{flow_run}"]
    parent = parents[0]
    params = load_params(params_file)
    # the resolved params, as dotted keys
    assert parent.data.params["sft.learning_rate"] == str(params.sft.learning_rate)
    assert parent.data.params["policy.method"] == "dpo"
    assert json.loads(parent.data.params["run.report_to"]) == report_to
    # score's and evaluate's metrics, equal to what the stages recorded
    evaluate = json.loads((output_dir(params, "evaluate") / "manifest.json").read_text())["metrics"]
    score = json.loads((output_dir(params, "score") / "manifest.json").read_text())["metrics"]
    assert parent.data.metrics["evaluate.accuracy"] == pytest.approx(evaluate["accuracy"])
    merged = evaluate["models"]["merged"]
    assert parent.data.metrics["evaluate.models.merged.bleu"] == pytest.approx(merged["bleu"])
    assert parent.data.metrics["score.pairs"] == score["pairs"]

    children = {r.data.tags["align.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") ==
                parent.info.run_id}
    assert set(children) == {"sft", "reward", "policy"}
    for stage, child in children.items():
        assert child.info.run_name == f"align-{flow_run}/{stage}" and child.info.status == "FINISHED"
        key, section = sections(params)[stage]  # policy: policy.dpo
        assert float(child.data.params["logging_steps"]) == section.logging_steps  # TrainingArguments
        assert float(child.data.params[f"{key}.max_steps"]) == section.max_steps  # the stage's params section
        losses = client.get_metric_history(child.info.run_id, "loss")
        assert [m.step for m in losses] == list(range(1, int(section.max_steps) + 1)), stage
        history = json.loads((output_dir(params, stage) / "log_history.json").read_text())
        logged = [h["loss"] for h in history if "loss" in h]
        assert [m.value for m in losses] == pytest.approx(logged), stage  # the curve the stage trained
    assert "eval_loss" in children["sft"].data.metrics  # the final evaluation after training: the same run

    if not WANDB:
        return
    runs = wandb_runs(tmp_path)
    print("\n".join(f"wandb {name} (group {r['group']}): loss {r['history'].get('train/loss')}"
                    for name, r in runs.items()))
    assert set(runs) == {f"align-{flow_run}/{s}" for s in ("sft", "reward", "policy", "score", "evaluate")}
    assert {(r["group"], r["project"]) for r in runs.values()} == {(f"align-{flow_run}", "align")}
    for stage in ("sft", "reward", "policy"):
        history = json.loads((output_dir(params, stage) / "log_history.json").read_text())
        logged = [h["loss"] for h in history if "loss" in h]
        assert runs[f"align-{flow_run}/{stage}"]["history"]["train/loss"] == pytest.approx(logged), stage
    assert runs[f"align-{flow_run}/evaluate"]["summary"]["evaluate.accuracy"] == pytest.approx(evaluate["accuracy"])
    assert runs[f"align-{flow_run}/score"]["summary"]["score.pairs"] == score["pairs"]
