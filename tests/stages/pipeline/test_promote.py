"""The promotion gate: first promotion, no-op on an unchanged model, a worse model kept out, a better one in."""
import dataclasses
import json
import os

import pytest

from stages.builtin import tiny
from stages.harness import runner
from stages.pipeline import promote as promotion
from tests.stages.test_adapter_merge import SIZE


def history(models):
    return [json.loads(line) for line in (models / "history.jsonl").read_text().splitlines()]


def test_gate_promotes_only_a_better_model(tmp_path):
    models = tmp_path / "models"
    first = tiny.build(tmp_path / "first", **SIZE, seed=0)
    worse = tiny.build(tmp_path / "worse", **SIZE, seed=1)
    better = tiny.build(tmp_path / "better", **SIZE, seed=2)
    kw = dict(metric="accuracy", min_improvement=0.05, eval_key="k")

    r = promotion.gate(first, {"accuracy": 0.60}, models, **kw)
    assert r["event"] == "promoted" and "no production model yet" in r["decision"]["reason"]
    v1 = r["production"]["version"]
    assert (models / "production").resolve() == (models / "releases" / v1).resolve()
    assert (models / "production" / "model.safetensors").is_file()

    r = promotion.gate(worse, {"accuracy": 0.40}, models, **kw)  # deliberately worse: kept out
    assert r["event"] == "kept" and "does not beat production's 0.6" in r["decision"]["reason"]
    assert promotion.current(models)["version"] == v1 and (models / "production").resolve().name == v1
    r = promotion.gate(worse, {"accuracy": 0.63}, models, **kw)  # better, but not by the margin
    assert r["event"] == "kept" and "by more than 0.05" in r["decision"]["reason"]

    r = promotion.gate(better, {"accuracy": 0.70}, models, **kw)
    assert r["event"] == "promoted" and r["decision"]["production"] == 0.60
    v2 = promotion.current(models)["version"]
    assert v2 != v1 and (models / "production").resolve().name == v2
    assert (models / "releases" / v1).is_dir()  # the old one is kept, never overwritten
    events = history(models)
    assert [e["event"] for e in events] == ["promoted", "kept", "kept", "promoted"]
    assert events[-1]["previous"]["version"] == v1  # the record of the previous production

    r = promotion.gate(better, {"accuracy": 0.70}, models, **kw)  # unchanged model: nothing to do
    assert r["event"] == "kept" and "is the production model" in r["decision"]["reason"]
    # production measured on another eval set: re-evaluated before comparing
    seen = []
    r = promotion.gate(first, {"accuracy": 0.72}, models, **{**kw, "eval_key": "new"},
                       evaluate_production=lambda path: seen.append(path) or {"accuracy": 0.5})
    assert seen == [str(models / "production")] and r["event"] == "promoted" and r["decision"]["production"] == 0.5


def test_decide_rules():
    assert promotion.decide(None, 0.5, metric="accuracy", min_improvement=0).promote is False
    assert promotion.decide(0.5, 0.5, metric="accuracy", min_improvement=0).promote is False  # a tie keeps production
    assert promotion.decide(0.51, 0.5, metric="accuracy", min_improvement=0).promote is True
    assert promotion.column("rouge") == "rougeL"


def test_decide_judges_a_share_with_its_sample_size():
    """0.70 vs 0.65 on 300 prompts each: the lower bound of the difference is -0.0129 (tests/stages/test_gates.py),
    so the lead is not shown at 95% and production stays; on 3000 prompts each it is; a non-share metric and
    confidence 0.5 compare the values themselves."""
    kw = dict(metric="accuracy", min_improvement=0.0, confidence=0.95)
    d = promotion.decide(0.70, 0.65, n_candidate=300, n_production=300, **kw)
    assert not d.promote and d.reason == (
        "accuracy 0.7 on 300 prompts against production's 0.65 on 300 (difference +0.05; one-sided 95% lower bound "
        "-0.01288): not shown better by more than 0.0 at 95% confidence; production kept (more eval prompts narrow "
        "the bound; promote.confidence 0.5 compares the values themselves)")
    assert promotion.decide(0.70, 0.65, n_candidate=3000, n_production=3000, **kw).promote
    assert promotion.decide(0.70, 0.65, n_candidate=300, n_production=300, **{**kw, "confidence": 0.5}).promote
    assert promotion.decide(0.70, 0.65, n_candidate=300, n_production=300, **{**kw, "metric": "bleu"}).promote
    assert promotion.decide(0.70, 0.65, **kw).promote  # counts unknown (a record from before): the values


def test_pipeline_gate_and_hub_not_configured(built_pipeline, tmp_path):
    params, manifests = built_pipeline
    secret = "hf_SECRET_token_never_written"
    p = dataclasses.replace(params, promote=dataclasses.replace(params.promote, models_dir=str(tmp_path / "models")))
    r = promotion.run_gate(p, env={"HF_TOKEN": secret})
    assert r["event"] == "promoted" and r["hub"] == {"pushed": False, "reason": "promote.hub.model_id is not set"}
    record = promotion.current(tmp_path / "models")
    assert record["lineage"]["method"] == "none" and record["metrics"]["model"] == "merged"
    assert promotion.run_gate(p, env={"HF_TOKEN": secret})["event"] == "kept"  # nothing changed: nothing promoted
    no_token = promotion.push_to_hub(tmp_path / "models" / "production", "me/model", env={})
    assert no_token == {"pushed": False, "reason": "HF_TOKEN is not in the environment; set it to push to me/model"}
    text = promotion.markdown(r)
    for root, _, files in os.walk(tmp_path / "models"):
        for f in files:
            assert secret.encode() not in open(os.path.join(root, f), "rb").read()
    assert secret not in text
    # production re-measured on the current eval set agrees with the evaluate table
    row = promotion.evaluate_production(p, str(tmp_path / "models" / "production"))
    merged = manifests["evaluate"]["metrics"]["models"]["merged"]
    assert row["accuracy"] == merged["accuracy"] and row["bleu"] == merged["bleu"]


def test_bad_candidate(built_pipeline, tmp_path):
    params, _ = built_pipeline
    p = dataclasses.replace(params, promote=dataclasses.replace(params.promote, candidate="nope",
                                                                models_dir=str(tmp_path)))
    with pytest.raises(promotion.PromotionError, match="promote.candidate = 'nope': not a row"):
        promotion.run_gate(p)
    assert runner.output_dir(params, "evaluate").is_dir()


def test_decide_on_an_lm_eval_metric_uses_its_stderr():
    """difference 0.6 - 0.5 = 0.1; lower bound 0.1 - z·√(se_c² + se_p²), z = 1.6449 at 95%:
    se 0.05 each: 0.1 - 1.6449·0.070711 = -0.01631 (kept); se 0.02 each: 0.1 - 1.6449·0.028284 = 0.05348."""
    col = "lm_eval.gsm8k.exact_match.strict-match"
    kept = promotion.decide(0.6, 0.5, metric=col, min_improvement=0.0, confidence=0.95, se_candidate=0.05,
                            se_production=0.05)
    assert kept.promote is False and kept.method == "stderr"
    assert kept.lower_bound == pytest.approx(0.1 - 1.6448536 * 0.0707107, abs=1e-5)
    won = promotion.decide(0.6, 0.5, metric=col, min_improvement=0.0, confidence=0.95, se_candidate=0.02,
                           se_production=0.02)
    assert won.promote is True and won.lower_bound == pytest.approx(0.05348, abs=1e-5) and won.improvement == 0.1
    assert promotion.stderr_of({col: 0.6, "lm_eval.gsm8k.exact_match_stderr.strict-match": 0.02}, col) == 0.02


def test_gate_on_lm_eval_and_on_the_judge_records_metric_and_interval(tmp_path):
    models = tmp_path / "models"
    first, second, third = (tiny.build(tmp_path / f"m{i}", **SIZE, seed=i) for i in range(3))
    col = "lm_eval.align_arithmetic.exact_match"
    se = "lm_eval.align_arithmetic.exact_match_stderr"
    kw = dict(metric=col, min_improvement=0.0, eval_key="k", confidence=0.95)
    assert promotion.gate(first, {col: 0.30, se: 0.02}, models, **kw)["event"] == "promoted"
    r = promotion.gate(second, {col: 0.33, se: 0.02}, models, **kw)  # +0.03, lower bound 0.03 - 0.0465 < 0
    assert r["event"] == "kept" and r["decision"]["method"] == "stderr"
    assert r["decision"]["lower_bound"] == pytest.approx(0.03 - 1.6448536 * 0.0282843, abs=1e-5)
    assert history(models)[-1]["lower_bound"] == r["decision"]["lower_bound"]  # history.jsonl carries the interval

    asked = []
    kw = dict(metric="judge.lc_win_rate", min_improvement=0.05, eval_key="k", confidence=0.95)
    r = promotion.gate(second, {"judge.lc_win_rate": 0.6}, models, **kw,
                       judge_production=lambda path: asked.append(path) or (0.62, 0.53))
    assert asked == [str(models / "production")]
    assert r["event"] == "kept" and r["decision"]["method"] == "judge"  # lower bound 0.53 - 0.5 = 0.03 <= 0.05
    assert r["decision"]["lower_bound"] == pytest.approx(0.03) and r["decision"]["improvement"] == pytest.approx(0.12)
    r = promotion.gate(third, {"judge.lc_win_rate": 0.7}, models, **kw, judge_production=lambda path: (0.7, 0.58))
    assert r["event"] == "promoted" and "lower bound 0.58" in r["decision"]["reason"]
    with pytest.raises(promotion.PromotionError, match="set evaluate.judge"):
        promotion.gate(first, {}, models, **kw)


def test_promote_metric_names():
    from stages.harness.config import PromoteParams

    ok = ["accuracy", "lm_eval.gsm8k.exact_match.strict-match", "lm_eval.arc_easy.acc", "judge.lc_win_rate"]
    assert all(PromoteParams(metric=m).validate() == [] for m in ok)
    for bad in ["length", "lm_eval.gsm8k", "judge.unreadable", "lm_eval.arc_easy.acc_stderr", "bleuu"]:
        [(key, message)] = PromoteParams(metric=bad).validate()
        assert key == "metric" and repr(bad) in message and "lm_eval.<task>.<metric>" in message
