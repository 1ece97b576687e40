"""Your own data, in every shape README lists, through every stage.

Each case either reaches `evaluate` or stops before any training (at params validation, or
in preprocess) with the override that fixes it in its message. The data is the built-in
task written out as a user's files (tests/pipelines.py); the model is the small built-in one.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.data import DataError, read_jsonl
from stages.harness.params_loader import ParamsError, load_params
from stages.harness.runner import run_stage
from tests.conftest import write_params
from tests.pipelines import arithmetic_files, evaluate_table, run_pipeline

pytestmark = pytest.mark.slow


def own(tmp_path: Path, data: dict, extra: dict | None = None) -> Path:
    """Small params reading `data` (no built-in task) with outputs under tmp_path."""
    return write_params(tmp_path, {"data": {"source": None, **data}, **(extra or {})})


def test_sft_only_stops_at_params_validation_naming_the_fix_then_runs_with_it(tmp_path):
    files = arithmetic_files(tmp_path)
    params_file = own(tmp_path, {"sft": str(files["sft"])})
    with pytest.raises(ParamsError) as e:
        load_params(params_file)
    assert ("score.reward_functions = ['reward_model'] includes reward_model, but there is no preference data to "
            "train one: set --set policy.method=grpo --set score.enabled=false (GRPO learns from the rule reward on "
            "every sample), or keep policy.method = dpo with --set score.reward_functions=[exact_match] "
            "if") in str(e.value)
    assert not (tmp_path / "artifacts").exists()  # nothing built, not even the model

    # the fix named first: an online method with the rule reward (the tiny model's rule-scored pairs would all tie)
    params = load_params(params_file, ["policy.method=grpo", "score.enabled=false"])
    manifests = run_pipeline(params)
    assert manifests["reward"]["metrics"] == {"trained": False, "reason": "no preference pairs in preference.jsonl"}
    assert [r["model"] for r in evaluate_table(params)] == ["base", "sft", "policy", "merged"]


def test_sft_only_default_params_name_the_weights_too(tmp_path):
    files = arithmetic_files(tmp_path)
    with pytest.raises(ParamsError, match=r"with --set score\.reward_functions=\[exact_match\] --set "
                                          r"score\.reward_weights=\[1\.0\] if the SFT model's samples"):
        load_params(write_params(tmp_path, {"data": {"source": None, "sft": str(files["sft"])}}, small=False))


def test_preference_only_trains_sft_on_the_chosen_side_and_reaches_evaluate(tmp_path):
    files = arithmetic_files(tmp_path)
    params = load_params(own(tmp_path, {"preference": str(files["preference"])}))
    manifests = run_pipeline(params)
    pre = manifests["preprocess"]["metrics"]
    assert pre["sft_from"] == "the chosen side of the preference rows"
    assert set(pre["dropped"]["preference"]) == {"duplicate", "eval_prompt", "dev_prompt"} and pre["dropped"][
        "preference"]["eval_prompt"] > 0 and pre["dropped"]["preference"]["dev_prompt"] > 0  # carved prompts left
    out = Path(params.run.output_dir) / "preprocess"
    eval_prompts = {json.dumps(r["prompt"]) for r in read_jsonl(out / "eval.jsonl")}
    # held-out prompts are trained on neither through SFT nor through the preference pairs
    assert not eval_prompts & {json.dumps(r["prompt"]) for r in read_jsonl(out / "preference.jsonl")}
    assert not eval_prompts & {json.dumps(r["prompt"]) for r in read_jsonl(out / "sft_train.jsonl")}
    dev_prompts = {json.dumps(r["prompt"]) for r in read_jsonl(out / "dev.jsonl")}
    assert dev_prompts and not dev_prompts & eval_prompts  # nor the dev prompts, which are not eval prompts
    for name in ("preference.jsonl", "sft_train.jsonl"):
        assert not dev_prompts & {json.dumps(r["prompt"]) for r in read_jsonl(out / name)}
    assert manifests["reward"]["metrics"]["trained"] is True
    assert [r["model"] for r in evaluate_table(params)] == ["base", "sft", "policy", "merged"]


def test_plain_text_with_a_model_without_chat_template_stays_plain_end_to_end(tmp_path, no_template_model):
    files = arithmetic_files(tmp_path, plain=True)
    params = load_params(own(tmp_path, {"source": str(files["mixed"])},
                             {"model": {"name_or_path": str(no_template_model)}}))
    run_pipeline(params)
    pairs = read_jsonl(Path(params.run.output_dir) / "score" / "pairs.jsonl")
    assert pairs and all(isinstance(r[k], str) for r in pairs for k in ("prompt", "chosen", "rejected"))
    assert "policy" in [r["model"] for r in evaluate_table(params)]


def test_conversational_data_with_a_model_without_chat_template_stops_in_preprocess(tmp_path, no_template_model):
    files = arithmetic_files(tmp_path)
    params = load_params(own(tmp_path, {"source": str(files["mixed"])},
                             {"model": {"name_or_path": str(no_template_model)}}))
    with pytest.raises(DataError, match=r"the data is conversational \(chat messages\), but model\.name_or_path = "
                                        r".* has no chat template: give the rows as plain strings"):
        run_stage("preprocess", params)
    assert not (Path(params.run.output_dir) / "preprocess").exists()


def test_mixed_single_file_reaches_evaluate(tmp_path):
    files = arithmetic_files(tmp_path)
    params = load_params(own(tmp_path, {"source": str(files["mixed"])}))
    manifests = run_pipeline(params)
    rows = manifests["preprocess"]["metrics"]["rows"]
    assert rows["preference"] > 0 and rows["prompts"] > 0 and rows["sft_train"] > 0
    report = json.loads((Path(params.run.output_dir) / "preprocess" / "report.json").read_text())
    assert report["sources"][0]["formats"] == {"messages": 300, "preference": 60, "prompt_only": 60}
    assert [r["model"] for r in evaluate_table(params)] == ["base", "sft", "policy", "merged"]


def test_separate_files_reach_evaluate(tmp_path):
    files = arithmetic_files(tmp_path)
    params = load_params(own(tmp_path, {k: str(files[k]) for k in ("sft", "preference", "prompts", )}
                             | {"eval_source": str(files["eval"])}))
    manifests = run_pipeline(params)
    assert manifests["preprocess"]["metrics"]["rows"]["eval"] == 20  # data.eval_source, not carved
    assert [s["key"] for s in json.loads((Path(params.run.output_dir) / "preprocess" / "report.json").read_text())
            ["sources"]] == ["data.sft", "data.preference", "data.prompts", "data.eval_source"]
    assert [r["model"] for r in evaluate_table(params)] == ["base", "sft", "policy", "merged"]


@pytest.mark.parametrize("extra, message", [
    ({"data": {"sft": "x.jsonl"}}, r"data\.source = 'builtin:arithmetic' together with data\.sft: .* set --set "
                                   r"data\.source=null"),
    ({"data": {"source": None}}, r"data\.source = null and no data\.sft, data\.preference or data\.prompts"),
])
def test_ambiguous_or_missing_sources_are_params_errors(tmp_path, extra, message):
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    extra = json.loads(json.dumps(extra).replace('"x.jsonl"', json.dumps(str(tmp_path / "x.jsonl"))))
    with pytest.raises(ParamsError, match=message):
        load_params(write_params(tmp_path, extra))


def test_prompts_only_stops_before_training(tmp_path):
    files = arithmetic_files(tmp_path)
    with pytest.raises(ParamsError, match=r"data holds prompts rows only: nothing for stage sft to train on; give "
                                          r"SFT rows \(data\.sft\)"):
        load_params(own(tmp_path, {"prompts": str(files["prompts"])}))


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory) -> Path:
    """The small built-in model with its chat template removed (a base model, like GPT-2)."""
    from stages.builtin import tiny

    folder = tiny.build(tmp_path_factory.mktemp("no-template"), hidden_size=32, num_layers=1, num_heads=2,
                        intermediate_size=64, vocab_size=384, seed=0)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    return folder
