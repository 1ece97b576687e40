"""DVCLive in a real git + DVC repository: a training stage with `report_to: [dvclive]` writes its curves
into its output, `align dvc-yaml` declares them, and `dvc exp show` / `dvc plots diff` show them."""
import json
import sys

import pytest
import yaml

from tests.test_dvc import commit, make_dvc_repo, sh

pytestmark = pytest.mark.slow
pytest.importorskip("dvclive", reason="pip install -e '.[trackers]'")


def test_exp_show_lists_each_training_stage_curves(tmp_path):
    repo = make_dvc_repo(tmp_path / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["run"]["report_to"] = ["dvclive"]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc_yaml = sh(sys.executable, "-m", "stages", "dvc-yaml", cwd=repo).stdout  # regenerated for these params
    (repo / "dvc.yaml").write_text(dvc_yaml)
    declared = yaml.safe_load(dvc_yaml)
    assert declared["metrics"] == [f"artifacts/{s}/dvclive/metrics.json" for s in ("sft", "reward", "policy")]
    commit(repo, "report to dvclive")

    out = sh("dvc", "exp", "run", "sft", "-n", "live", cwd=repo).stdout  # preprocess and sft only
    assert "Running stage 'sft'" in out and "Running stage 'reward'" not in out, out
    live = repo / "artifacts" / "sft" / "dvclive"
    steps = [int(line.split("\t")[0]) for line in
             (live / "plots" / "metrics" / "train" / "loss.tsv").read_text().splitlines()[1:]]
    history = json.loads((repo / "artifacts" / "sft" / "log_history.json").read_text())
    assert steps == [h["step"] for h in history if "train_loss" in h]  # x: the trainer's step
    losses = (live / "plots" / "metrics" / "loss.tsv").read_text().splitlines()
    assert [int(line.split("\t")[0]) for line in losses[1:]] == [h["step"] for h in history if "loss" in h]
    assert not (live / "dvc.yaml").exists()  # declared by the project's dvc.yaml, not by DVCLive

    shown = json.loads(sh("dvc", "exp", "show", "--json", cwd=repo).stdout)
    head = shown[1]
    exps = {x.get("name"): x for r in head.get("experiments") or [] for x in r["revs"]}
    metrics = exps["live"]["data"]["metrics"]
    sft = metrics["artifacts/sft/dvclive/metrics.json"]["data"]
    assert set(sft) >= {"loss", "step", "eval", "train"} and sft["step"] == 4, sft
    header = sh("dvc", "exp", "show", "--no-pager", "--csv", cwd=repo).stdout.splitlines()[0].split(",")
    assert {"loss", "grad_norm", "learning_rate", "step", "eval.loss", "train.loss"} <= set(header), header
    print(sh("dvc", "exp", "show", "--no-pager", "--md", "--only-changed", "--drop", "Created|State|Executor|rev|typ|"
             "parent|.*_per_second|.*runtime|total_flos|num_tokens|stages/.*|artifacts/.*", cwd=repo).stdout)

    plots = json.loads(sh("dvc", "plots", "diff", "--json", "--split", cwd=repo).stdout)["data"]
    curve = plots["artifacts/sft/dvclive/plots/metrics/loss.tsv"]  # sft's loss curve, step by step
    points = [p for entry in curve for p in entry["anchor_definitions"]["<DVC_METRIC_DATA>"]]
    assert [int(p["step"]) for p in points] == [h["step"] for h in history if "loss" in h], curve
