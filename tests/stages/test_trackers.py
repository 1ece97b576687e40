"""stages/trackers.py: report_to inheritance, the names tracker runs share, what TrainingArguments gets."""
import dataclasses
import os
import subprocess
import sys

import pytest

from stages import trackers
from stages.harness.params_loader import load_params
from stages.harness.runner import StageContext
from tests.conftest import ROOT, write_params


def test_sections_inherit_run_report_to(tmp_path):
    p = load_params(write_params(tmp_path), ["run.report_to=[tensorboard, mlflow]", "reward.report_to=none",
                                             "policy.dpo.report_to=dvclive"])
    assert trackers.stage_trackers(p, "sft") == ["tensorboard", "mlflow"]  # null: run's
    assert trackers.stage_trackers(p, "reward") == []
    assert trackers.stage_trackers(p, "policy") == ["dvclive"]
    assert trackers.pipeline_trackers(p) == ["dvclive", "mlflow", "tensorboard"]
    assert load_params(ROOT / "params.yaml").sft.report_to is None  # the shipped params inherit run.report_to


def test_tracker_args_pass_only_what_transformers_builds(tmp_path, monkeypatch):
    monkeypatch.delenv(trackers.RUN_ENV, raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    p = load_params(write_params(tmp_path))
    ctx = StageContext(params=p, out=tmp_path, inputs={}, log=None, work=tmp_path, stage="sft")
    assert trackers.tracker_args(ctx, "sft", ["tensorboard", "dvclive"]) == {"report_to": "none"}  # no named runs
    args = trackers.tracker_args(ctx, "sft", ["mlflow", "trackio", "clearml"])
    assert args["report_to"] == ["trackio", "clearml"]  # mlflow: stages.trackers' own nested-run callback
    assert args["run_name"] == f"{trackers.pipeline_run(p)}/sft" and args["project"] == "align"
    assert [type(c).__name__ for c in trackers.callbacks(ctx, "sft", ["tensorboard", "dvclive", "mlflow"])] == [
        "TensorBoardCallback", "StageDVCLive", "NestedMLflow"]


def test_pipeline_run_name(tmp_path, monkeypatch):
    monkeypatch.delenv(trackers.RUN_ENV, raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    p = load_params(write_params(tmp_path))
    name = trackers.pipeline_run(p)
    assert name.startswith("align-p") and len(name) == len("align-p") + 8
    # where and how a run computes, and where it reports, do not change which run it is; what it computes does
    same = dataclasses.replace(p, run=dataclasses.replace(p.run, output_dir="elsewhere", threads=4,
                                                          report_to=["mlflow"]))
    assert trackers.pipeline_run(same) == name
    other = dataclasses.replace(p, sft=dataclasses.replace(p.sft, learning_rate=1e-5))
    assert trackers.pipeline_run(other) != name
    monkeypatch.setenv("DVC_EXP_NAME", "brisk-lamb")
    assert trackers.pipeline_run(p) == "align-brisk-lamb"  # under dvc exp run
    monkeypatch.setenv(trackers.RUN_ENV, "align-quizzical-emu")
    assert trackers.run_name(p, "policy") == "align-quizzical-emu/policy"  # set by the flow


def test_pipeline_run_is_the_same_in_every_stage_process(tmp_path):
    """`python -m stages` runs and `dvc repro`: a fresh process per stage finds the same name."""
    params = write_params(tmp_path)
    code = ("import sys; from stages.harness.params_loader import load_params; "
            "from stages.trackers import pipeline_run; print(pipeline_run(load_params(sys.argv[1])))")
    env = {k: v for k, v in os.environ.items() if k not in (trackers.RUN_ENV, "DVC_EXP_NAME")}
    env["PYTHONPATH"] = str(ROOT)
    names = {subprocess.run([sys.executable, "-c", code, str(params)], capture_output=True, text=True, env=env,
                            check=True).stdout.strip() for _ in range(2)}
    assert len(names) == 1 and names.pop() == trackers.pipeline_run(load_params(params))


@pytest.mark.parametrize("value, expected", [("mlflow", ["mlflow"]), ("none", []), ([], []), (None, None),
                                             (["none"], [])])
def test_normalise(value, expected):
    assert trackers.normalise(value) == expected
