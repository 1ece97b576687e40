"""A dataset folder in the hub's layout, with its own column names, through the whole pipeline.

Two splits (train as two parquet shards, test) and a README with their configs; `data.sft` reads the train split
and `data.eval_source` the test split, both through a column map. The run reaches `evaluate`, and preprocess has
the fingerprint (and the outputs) of the same rows given as .jsonl files.
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params
from tests.pipelines import arithmetic_rows, evaluate_table, hub_layout_folder, run_pipeline, write_jsonl

COLUMNS = {"question": "prompt", "answer": "completion"}
EXTRA = {"score": {"reward_functions": ["exact_match"], "reward_weights": None}, "policy": {"method": "grpo"}}


def test_hub_layout_folder_with_a_column_map_reaches_evaluate_like_its_jsonl_twin(tmp_path):
    rows = arithmetic_rows(plain=True)
    folder = hub_layout_folder(tmp_path / "arith", {"train": rows["sft"], "test": rows["eval"]}, {"train": 2},
                               rename={"prompt": "question", "completion": "answer"})
    hub = {"source": None, "sft": {"path": str(folder), "split": "train", "columns": COLUMNS},
           "eval_source": {"path": str(folder), "split": "test", "columns": COLUMNS}}
    twin = {"source": None, "sft": str(write_jsonl(tmp_path / "sft.jsonl", rows["sft"])),
            "eval_source": str(write_jsonl(tmp_path / "eval.jsonl", rows["eval"]))}
    (tmp_path / "hub").mkdir()
    (tmp_path / "jsonl").mkdir()
    params = load_params(write_params(tmp_path / "hub", {"data": hub, **EXTRA}))
    as_jsonl = load_params(write_params(tmp_path / "jsonl", {"data": twin, **EXTRA}))
    assert runner.inspect("preprocess", params).fingerprint == runner.inspect("preprocess", as_jsonl).fingerprint

    manifests = run_pipeline(params)
    assert manifests["preprocess"]["metrics"]["rows"]["eval"] == len(rows["eval"])  # the test split, not carved
    out = Path(params.run.output_dir) / "preprocess"
    sources = json.loads((out / "report.json").read_text())["sources"]
    assert [(s["key"], s["kept"], s["dataset"]["split"]) for s in sources] == [
        ("data.sft", len(rows["sft"]), "train"), ("data.eval_source", len(rows["eval"]), "test")]
    assert [r["model"] for r in evaluate_table(params)] == ["base", "sft", "policy", "merged"]

    twin_pre = runner.run_stage("preprocess", as_jsonl)
    assert twin_pre["fingerprint"] == manifests["preprocess"]["fingerprint"]
    splits = {k: v for k, v in twin_pre["outputs"]["files"].items() if k != "report.json"}  # it names the sources
    assert splits == {k: v for k, v in manifests["preprocess"]["outputs"]["files"].items() if k != "report.json"}
