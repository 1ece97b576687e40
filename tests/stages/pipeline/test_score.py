"""Stage `score`: sampled completions scored into filtered preference pairs, every drop counted."""
import json
import shutil
from types import SimpleNamespace

import pytest

from stages.data import read_jsonl
from stages.harness import runner
from stages.harness.params_loader import ParamsError, load_params
from stages.pipeline.score import build_pairs
from tests.conftest import write_params


def test_score_stage_outputs(built_pipeline):
    params, manifests = built_pipeline
    m = manifests["score"]["metrics"]
    assert m["prompts"] == 12 and m["completions"] == 36  # score.num_prompts x score.n
    folder = runner.output_dir(params, "score")
    pairs = read_jsonl(folder / "pairs.jsonl")
    assert len(pairs) == m["pairs"] > 0
    assert all(p["chosen_score"] > p["rejected_score"] and p["chosen"] != p["rejected"] for p in pairs)
    assert all("answer" in p for p in pairs)  # the prompt's columns travel with its pairs
    scores = read_jsonl(folder / "scores.jsonl")
    assert len(scores) == 36 and "score/reward_model" in scores[0]
    assert sum(m["histogram"]["counts"]) == 36 - m["unscored"]
    # every prompt is accounted for: a pair, or a counted reason
    dropped = sum(v for k, v in m["filtered"].items() if k.startswith("prompts_"))
    assert len({json.dumps(p["prompt"]) for p in pairs}) + dropped == 12
    assert 0 <= m["chosen_correct"] <= 1


def _s(**kw):
    base = dict(pairing="best_worst", min_margin=0.0, min_score=None, max_length=100, dedup=True)
    return SimpleNamespace(**{**base, **kw})


ROWS = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1"}, {"prompt": "p2"}]


def test_best_worst_pairs_ties_none_and_duplicates():
    index = [0, 0, 0, 1, 1, 2, 2]
    texts = ["a", "b", "a", "c", "d", "e", "f"]
    scores = [1.0, 0.0, 5.0, 2.0, 2.0, None, 3.0]  # p0: the duplicate "a" (5.0) is dropped; p1 tied; p2 one scored
    pairs, counts = build_pairs(ROWS, index, texts, scores, [10] * 7, _s())
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("a", "b")]  # string prompts: string completions
    assert pairs[0]["answer"] == "1" and pairs[0]["chosen_score"] == 1.0
    assert counts == {"duplicate_completions": 1, "prompts_all_tied": 1, "unscored_completions": 1,
                      "prompts_without_two_completions": 1}


def test_pairs_take_the_form_of_their_prompt():
    """Plain strings end to end: a string prompt gets string completions (no chat template needed downstream),
    chat messages get one assistant message each."""
    chat = [{"prompt": [{"role": "user", "content": "2+2"}]}]
    pairs, _ = build_pairs(chat + ROWS, [0, 0, 1, 1], ["4", "5", "a", "b"], [1.0, 0.0, 1.0, 0.0], [10] * 4, _s())
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "4"}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": "5"}]
    assert (pairs[1]["prompt"], pairs[1]["chosen"], pairs[1]["rejected"]) == ("p0", "a", "b")


def test_all_pairs_margin_score_and_length_filters():
    index, texts = [0, 0, 0, 0], ["a", "b", "c", "d"]
    scores, lengths = [0.0, 0.5, 2.0, 9.0], [10, 10, 10, 500]
    pairs, counts = build_pairs(ROWS, index, texts, scores, lengths, _s(pairing="all_pairs", min_margin=0.6))
    assert sorted((p["chosen"], p["rejected"]) for p in pairs) == [("c", "a"), ("c", "b")]
    assert counts == {"too_long_completions": 1, "pairs_below_min_margin": 1}
    pairs, counts = build_pairs(ROWS, index, texts, scores, [10] * 4, _s(min_score=10.0))
    assert pairs == [] and counts == {"pairs_below_min_score": 1, "prompts_without_pairs": 1}


def test_offline_mode_scores_existing_completions(tmp_path, built_pipeline):
    params, _ = built_pipeline
    data = tmp_path / "generations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": [{"role": "user", "content": "12+30"}], "answer": "42",
         "completions": ["<think>2+0=2, 1+3=4</think>42", "<think>2+0=2, 1+3=4</think>41", "40"]},
        {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2", "completions": ["2", "2"]}]))
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")  # its own copy: other tests read the original
    offline = load_params(write_params(tmp_path, {"score": {
        "source": "dataset", "dataset": str(data), "reward_functions": ["exact_match", "reasoning_format"],
        "reward_weights": [1.0, 0.1]}}))
    m = runner.run_stage("score", offline)["metrics"]
    assert m["backend"] == "dataset" and m["completions"] == 5
    pairs = read_jsonl(runner.output_dir(offline, "score") / "pairs.jsonl")
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("<think>2+0=2, 1+3=4</think>42", "40")]
    assert pairs[0]["chosen_score"] == pytest.approx(1.1) and m["chosen_correct"] == 1.0
    assert m["filtered"] == {"duplicate_completions": 1, "prompts_without_two_completions": 1}


@pytest.mark.parametrize("function, message", [
    ("nowhere.module:score", r"score.reward_functions\[0\] = 'nowhere.module:score'.*nowhere"),
    ("json:no_such_function", r"score.reward_functions\[0\] = 'json:no_such_function'.*no_such_function"),
    ("json:__name__", r"score.reward_functions\[0\] = 'json:__name__'.*not callable"),
])
def test_bad_reward_function_fails_before_sampling(tmp_path, built_pipeline, function, message):
    params, _ = built_pipeline
    manifest = runner.output_dir(params, "score") / "manifest.json"
    before = manifest.read_bytes()
    bad = load_params(write_params(tmp_path, {"run": {"output_dir": params.run.output_dir},
                                              "score": {"reward_functions": [function]}}))
    with pytest.raises(ValueError, match=message):
        runner.run_stage("score", bad)
    assert manifest.read_bytes() == before  # the previous output is untouched, nothing half-written


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ParamsError) as e:
        load_params(write_params(tmp_path, {"score": {"n": 1, "reward_functions": ["exact_match", "oops"],
                                                      "reward_weights": [1.0]}}))
    text = str(e.value)
    assert "score.n = 1: pairs need at least 2 completions per prompt" in text
    assert "score.reward_functions[1] = 'oops': neither a built-in" in text
    assert "score.reward_weights = [1.0]: 1 weight(s) for 2 reward function(s)" in text
