import json

import pytest

from stages.data import read_jsonl
from stages.harness import runner
from stages.harness.params_loader import load_params
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
    assert m["rows"]["eval"] + m["rows"]["dev"] + m["rows"]["sft_train"] + m["rows"]["sft_validation"] == 40  # 43 - 3
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
    assert m["rows"]["sft_train"] + m["rows"]["sft_validation"] + m["rows"]["dev"] == 60  # eval_source: no eval carved


# --------------------------------------------------------------------------- the dev split

TRAINING_FILES = ("sft_train.jsonl", "sft_validation.jsonl", "preference.jsonl", "unpaired.jsonl", "prompts.jsonl")


def _prompts(folder, name: str) -> set[str]:
    path = folder / name
    return {json.dumps(r["prompt"], sort_keys=True) for r in read_jsonl(path) if "prompt" in r} if path.exists() \
        else set()


def _overlapping_rows() -> list[dict]:
    """SFT rows (a fifth of the prompts twice, with another completion), preference and prompt rows whose prompts
    are SFT prompts: carving by row alone would leave dev prompts in the training files."""
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(200)]
    rows += [{"prompt": f"q{i}", "completion": f"b{i}"} for i in range(0, 200, 5)]
    rows += [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(0, 200, 2)]
    return rows + [{"prompt": f"q{i}"} for i in range(0, 200, 3)]


def _data_case(tmp_path, case: str) -> dict:
    """The params extra of each way a dev split is made."""
    if case == "builtin":
        return {}
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _overlapping_rows()))
    own = {"data": {"source": str(data)}, "preprocess": {"eval_fraction": 0.1, "dev_fraction": 0.1}}
    if case == "streaming":
        own["preprocess"]["streaming"] = True
    if case == "derived":  # no SFT rows: SFT, eval and dev all come from the preference rows
        data.write_text("".join(json.dumps(r) + "\n" for r in _overlapping_rows() if "chosen" in r))
    if case == "dev_source":  # the user's dev file, overlapping the eval file and the training rows
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n"
                                                     for i in range(0, 20)))
        (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n"
                                                    for i in range(10, 40)))
        own["data"].update(eval_source=str(tmp_path / "eval.jsonl"), dev_source=str(tmp_path / "dev.jsonl"))
    return own


@pytest.mark.parametrize("case", ["builtin", "in_memory", "derived", "streaming", "dev_source"])
def test_dev_split_is_disjoint_from_eval_and_training_and_deterministic(tmp_path, case):
    params = load_params(write_params(tmp_path, _data_case(tmp_path, case)))
    m = runner.run_stage("preprocess", params)["metrics"]
    folder = runner.output_dir(params, "preprocess")
    dev = _prompts(folder, "dev.jsonl")
    assert len(dev) == m["rows"]["dev"] == len(read_jsonl(folder / "dev.jsonl")) > 0  # one row per dev prompt
    assert not dev & _prompts(folder, "eval.jsonl")
    for name in TRAINING_FILES:
        assert not dev & _prompts(folder, name), name
    assert all(r.get("completion") for r in read_jsonl(folder / "dev.jsonl"))  # references to score against
    report = json.loads((folder / "report.json").read_text())
    assert report["rows"]["dev"] == m["rows"]["dev"]
    if case == "builtin":
        assert m["rows"]["dev"] == params.data.builtin.num_dev and m["rows"]["eval"] == params.data.builtin.num_eval
    if case == "in_memory":  # the other rows of the dev prompts were removed and counted, in every training kind
        assert {name for name, why in m["dropped"].items() if why.get("dev_prompt")} == {"sft", "preference",
                                                                                        "prompts"}
    if case == "dev_source":  # q10..q19 are eval prompts too: eval keeps them, dev loses them
        assert m["dropped"]["dev"]["eval_prompt"] == 10 and m["rows"]["dev"] == 20
        assert dev == {json.dumps(f"q{i}") for i in range(20, 40)}
    first = {name: (folder / name).read_bytes() for name in ("dev.jsonl", "eval.jsonl", *TRAINING_FILES)
             if (folder / name).exists()}
    runner.run_stage("preprocess", params, force=True)
    assert {name: (folder / name).read_bytes() for name in first} == first  # the same split, byte for byte


def test_builtin_eval_split_does_not_move_with_the_dev_split(tmp_path):
    """Adding dev prompts takes them from the training sums, never from eval: eval figures stay comparable."""
    from stages.builtin import arithmetic

    sizes = {"num_train": 300, "num_preference": 50, "num_eval": 40, "digits": 2, "error_rate": 0.7,
             "reasoning": True, "seed": 0}
    without, with_dev = arithmetic.generate(**sizes, num_dev=0), arithmetic.generate(**sizes, num_dev=40)
    assert without["eval"] == with_dev["eval"] and not without["dev"] and len(with_dev["dev"]) == 40
    with pytest.raises(ValueError, match=r"data\.builtin\.num_eval \+ num_dev = 40 \+ 8100"):
        arithmetic.generate(**sizes, num_dev=8100)
