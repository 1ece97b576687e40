import json

import pytest

from stages import runner
from stages.config import load_params
from stages.data import read_jsonl
from tests.conftest import write_params

RULE_REWARDS = {"score": {"reward_functions": ["exact_match"]}}  # SFT-only files train no reward model


def test_builtin_outputs(built_pipeline):
    params, manifests = built_pipeline
    folder = runner.output_dir(params, "preprocess")
    files = set(manifests["preprocess"]["outputs"]["files"])
    assert {"sft_train.jsonl", "sft_validation.jsonl", "eval.jsonl", "preference.jsonl", "unpaired.jsonl",
            "prompts.jsonl", "report.json"} <= files
    train = read_jsonl(folder / "sft_train.jsonl")
    evals = read_jsonl(folder / "eval.jsonl")
    assert train[0]["prompt"][0]["role"] == "user" and train[0]["completion"][0]["role"] == "assistant"
    assert not {json.dumps(r["prompt"]) for r in evals} & {json.dumps(r["prompt"]) for r in train}
    rows = manifests["preprocess"]["metrics"]["rows"]
    assert rows["sft_train"] + rows["sft_validation"] + manifests["preprocess"]["metrics"]["dropped"]["sft"][
        "duplicate"] == 400


def test_real_file_dedup_length_filter_and_skipped_rows(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(40)]
    rows += [rows[0], {"prompt": "long " * 400, "completion": "x"}]
    lines = [json.dumps(r) for r in rows] + ["{broken"]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    params = load_params(write_params(tmp_path, {
        "data": {"source": str(tmp_path / "data.jsonl"), "on_bad_rows": "skip"}, **RULE_REWARDS,
        "preprocess": {"max_length": 64, "eval_fraction": 0.1, "validation_fraction": 0.1}}))
    m = runner.run_stage("preprocess", params)["metrics"]
    assert m["invalid_rows"] == 1
    assert m["dropped"]["sft"] == {"duplicate": 1, "too_long": 1}
    assert m["rows"]["eval"] + m["rows"]["sft_train"] + m["rows"]["sft_validation"] == 40  # 43 read - 3 dropped
    report = json.loads((tmp_path / "artifacts" / "preprocess" / "report.json").read_text())
    assert report["sources"][0]["invalid_examples"][0].startswith(f"{tmp_path / 'data.jsonl'}:43: invalid JSON")


def test_bad_file_fails_the_stage_and_writes_nothing(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "q", "completion": ""}\n')
    params = load_params(write_params(tmp_path, {"data": {"source": str(tmp_path / "data.jsonl")}, **RULE_REWARDS}))
    with pytest.raises(ValueError, match=r"data.jsonl:1: field 'completion' is empty"):
        runner.run_stage("preprocess", params)
    assert not (tmp_path / "artifacts" / "preprocess").exists()


def test_streaming_matches_in_memory_counts_and_is_deterministic(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(400)] + [{"prompt": "q0", "completion": "a0"}]
    rows.append({"prompt": "long " * 400, "completion": "x"})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    extra = {"data": {"source": str(tmp_path / "data.jsonl"), "on_bad_rows": "skip"},
             "preprocess": {"max_length": 64, "streaming": True, "eval_fraction": 0.1, "validation_fraction": 0.1}}
    params = load_params(write_params(tmp_path, extra))
    m = runner.run_stage("preprocess", params)["metrics"]
    assert m["streaming"] and m["invalid_rows"] == 1
    assert m["dropped"]["sft"] == {"duplicate": 1, "too_long": 1}
    assert sum(m["rows"].values()) == 400 and 20 < m["rows"]["eval"] < 65 and 20 < m["rows"]["sft_validation"] < 65
    folder = tmp_path / "artifacts" / "preprocess"
    eval_prompts = {r["prompt"] for r in read_jsonl(folder / "eval.jsonl")}
    assert not eval_prompts & {r["prompt"] for r in read_jsonl(folder / "sft_train.jsonl")}
    first = (folder / "eval.jsonl").read_text()
    runner.run_stage("preprocess", params, force=True)
    assert (folder / "eval.jsonl").read_text() == first  # the hash split is deterministic


def test_streaming_reads_every_data_key_and_the_eval_source(tmp_path):
    sft = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(60)]
    pairs = [{"prompt": f"p{i}", "chosen": "y", "rejected": "n"} for i in range(10)]
    for name, rows in (("sft", sft), ("pairs", pairs), ("eval", sft[:5])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = load_params(write_params(tmp_path, {
        "data": {"source": None, "sft": str(tmp_path / "sft.jsonl"), "preference": str(tmp_path / "pairs.jsonl"),
                 "eval_source": str(tmp_path / "eval.jsonl")},
        "preprocess": {"streaming": True, "validation_fraction": 0.1}}))
    m = runner.run_stage("preprocess", params)["metrics"]
    assert m["rows"]["eval"] == 5 and m["rows"]["preference"] == 10
    assert m["rows"]["sft_train"] + m["rows"]["sft_validation"] == 60  # nothing carved: eval_source is given
