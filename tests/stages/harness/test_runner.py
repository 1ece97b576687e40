"""The stage contract: atomic outputs, a complete manifest, reuse when current, nothing half-written."""
import json

import pytest

from stages.harness import artifacts, runner
from stages.harness.params_loader import load_params
from stages.harness.registry import STAGES
from tests.conftest import STAGE_ORDER, write_params

MANIFEST_KEYS = {"stage", "fingerprint", "params", "inputs", "code", "outputs", "metrics", "started_at",
                 "wall_time_s", "versions", "logs", "determinism"}


def test_manifest_records_everything(built_pipeline):
    params, manifests = built_pipeline
    sft = manifests["sft"]
    assert MANIFEST_KEYS <= set(sft)
    assert sft["inputs"]["preprocess"]["outputs_hash"] == manifests["preprocess"]["outputs"]["hash"]
    assert set(sft["params"]) == {"model", "sft", "run.seed", "run.report_to"}
    assert "model/model.safetensors" in sft["outputs"]["files"]
    assert {"torch", "transformers", "python"} <= set(sft["versions"])
    for name, manifest in manifests.items():  # the code: the stage module's import closure
        assert manifest["code"]["paths"] == list(STAGES[name].code())
        assert manifest["code"]["hash"] == artifacts.code_hash(STAGES[name].code())
    on_disk = json.loads((runner.output_dir(params, "sft") / "manifest.json").read_text())
    assert on_disk["outputs"] == sft["outputs"]
    dvc_metrics = json.loads(runner.metrics_path(params, "evaluate").read_text())
    assert dvc_metrics["accuracy"] == manifests["evaluate"]["metrics"]["accuracy"]


def test_second_call_reuses(built_pipeline):
    params, manifests = built_pipeline
    again = runner.run_stage("sft", params)
    assert again["executed"] is False and again["fingerprint"] == manifests["sft"]["fingerprint"]


def test_status_reports_current(built_pipeline):
    params, _ = built_pipeline
    assert [r["current"] for r in runner.status(params)] == [True] * len(STAGE_ORDER)


def test_changed_param_makes_stage_and_downstream_stale(built_pipeline):
    params, _ = built_pipeline
    import dataclasses

    changed = dataclasses.replace(params, sft=dataclasses.replace(params.sft, learning_rate=0.5))
    assert runner.inspect("preprocess", changed).current
    st = runner.inspect("sft", changed)
    assert not st.current and st.reason.startswith("stale")


def test_upstream_missing_is_a_clear_error(tmp_path):
    params = load_params(write_params(tmp_path))
    with pytest.raises(runner.UpstreamMissing, match=r"needs the output of 'preprocess'.*python -m stages preprocess"):
        runner.run_stage("sft", params)


def test_crashing_stage_leaves_nothing(tmp_path, monkeypatch):
    params = load_params(write_params(tmp_path))

    def crash(ctx):
        (ctx.out / "half.jsonl").write_text("{}\n")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(runner, "resolve", lambda target: crash)
    with pytest.raises(RuntimeError, match="killed"):
        runner.run_stage("preprocess", params)
    out = tmp_path / "artifacts"
    assert not (out / "preprocess").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")] if out.exists() else True
