import json
import re

import pytest

from stages.data import DataError, read_jsonl
from stages.harness import runner
from stages.metrics import load_metric
from stages.pipeline.evaluate import after_reasoning, check_references, extract


def test_table_has_base_sft_policy_and_merged_rows(built_pipeline):
    params, manifests = built_pipeline
    table = manifests["evaluate"]["metrics"]["table"]
    assert [r["model"] for r in table] == ["base", "sft", "policy", "merged"]
    for r in table:
        assert {"accuracy", "bleu", "rouge1", "rougeL", "reward", "win_rate", "format",
                "mean_completion_tokens"} <= set(r)
    out = runner.output_dir(params, "evaluate")
    preds = read_jsonl(out / "predictions.jsonl")
    assert len(preds) == 4 * 20
    for label in ("base", "sft", "policy", "merged"):
        rows = [p for p in preds if p["model"] == label]
        acc = sum(p["correct"] for p in rows) / len(rows)
        assert abs(acc - next(r["accuracy"] for r in table if r["model"] == label)) < 1e-3
    # the merged model is the policy model: greedy decoding with the same seed gives the same completions
    by = {label: [p["completion"] for p in preds if p["model"] == label] for label in ("policy", "merged")}
    assert by["merged"] == by["policy"]
    policy, merged = table[2], table[3]
    assert {k: v for k, v in merged.items() if k != "model"} == {k: v for k, v in policy.items() if k != "model"}
    assert table[1]["win_rate"] == 0.5  # sft against itself
    assert json.loads((out / "metrics.json").read_text()) == table
    report = (out / "report.md").read_text()
    assert "| merged |" in report and "plots/accuracy.png" in report
    for name in ("loss_curves.png", "reward_distribution.png", "accuracy.png", "loss_sft.json", "accuracy.json"):
        assert (out / "plots" / name).stat().st_size > 0, name
    flat = json.loads((runner.metrics_path(params, "evaluate")).read_text())  # what `dvc metrics show` reads
    assert flat["models.merged.accuracy"] == merged["accuracy"]


def test_local_metric_modules_through_evaluate():
    bleu = load_metric("bleu").compute(predictions=["the cat sat on the mat"], references=["the cat sat on the mat"])
    assert bleu["bleu"] == pytest.approx(100.0)
    # one wrong 4-gram chain: precisions 5/6, 3/5, 2/4, 1/3 -> BLEU = 100 * (5/6*3/5*2/4*1/3)^(1/4)
    got = load_metric("bleu").compute(predictions=["the cat sat on a mat"], references=["the cat sat on the mat"])
    assert got["bleu"] == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, rel=1e-6)
    rouge = load_metric("rouge").compute(predictions=["the cat sat", "x y"], references=["the cat sat down", "x y"])
    assert rouge["rouge1"] == pytest.approx((2 * 3 / 7 + 1) / 2)  # F1 of 3/3 precision, 3/4 recall; then 1


def test_reference_metrics_need_references(tmp_path):
    rows = [{"prompt": "1+1", "completion": "2"}, {"prompt": "2+2"}]
    with pytest.raises(DataError, match=r"evaluate.metrics includes \['accuracy', 'bleu'\].*1 of 2 eval rows"):
        check_references(rows, ["accuracy", "bleu", "reward"], tmp_path / "eval.jsonl")
    check_references(rows, ["reward", "format", "length"], tmp_path / "eval.jsonl")  # no reference needed


def test_extract_answer():
    pat = re.compile(r"(-?\d+)\s*$")
    assert extract("132", pat) == "132"
    assert extract("<think>7+5=12</think>132", pat) == "132"
    assert extract("<think>7+5=12", pat) is None  # never closed: no answer
    assert extract("the answer is", pat) is None
    assert extract("  Paris ", None) == "Paris"
    assert after_reasoning("a</think>b</think>c") == "c"


def test_a_crashed_evaluate_reuses_the_outputs_it_finished(tmp_path, built_pipeline, monkeypatch):
    """The models evaluated before a crash are not generated again on the rerun."""
    import shutil

    from stages.harness.params_loader import load_params
    from stages.pipeline import evaluate
    from tests.conftest import write_params

    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")
    p = load_params(write_params(tmp_path, {"evaluate": {"max_new_tokens": 5}}))
    calls, real = [], evaluate.generate_outputs

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "generate_outputs", crash_on_third)
    with pytest.raises(RuntimeError, match="killed"):
        runner.run_stage("evaluate", p)
    calls.clear()
    monkeypatch.setattr(evaluate, "generate_outputs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    table = runner.run_stage("evaluate", p)["metrics"]["table"]
    assert len(table) == 4 and len(calls) == 2  # base and sft were reused; policy and merged generated now


def test_dev_split_scores_the_dev_prompts_and_the_gate_refuses_it(built_pipeline, tmp_path):
    """evaluate.split: dev scores dev.jsonl (what tuning selects on) and says so; promotion compares on eval only."""
    import dataclasses
    import shutil

    from stages.pipeline import promote as promotion

    params, manifests = built_pipeline
    out = tmp_path / "artifacts"
    shutil.copytree(params.run.output_dir, out, symlinks=True)  # the session's pipeline stays as it is
    p = dataclasses.replace(params, run=dataclasses.replace(params.run, output_dir=str(out)),
                            evaluate=dataclasses.replace(params.evaluate, split="dev"),
                            promote=dataclasses.replace(params.promote, models_dir=str(tmp_path / "models")))
    m = runner.run_stage("evaluate", p)
    assert m["executed"] and m["metrics"]["split"] == "dev" and manifests["evaluate"]["metrics"]["split"] == "eval"
    dev = read_jsonl(out / "preprocess" / "dev.jsonl")
    preds = read_jsonl(out / "evaluate" / "predictions.jsonl")
    assert [r["prompt"] for r in preds if r["model"] == "sft"] == [r["prompt"] for r in dev]
    assert {r["split"] for r in json.loads((out / "evaluate" / "metrics.json").read_text())} == {"dev"}
    assert "split dev" in (out / "evaluate" / "report.md").read_text()
    with pytest.raises(promotion.PromotionError, match=r"evaluate\.split = dev: .* --set evaluate\.split=eval"):
        promotion.run_gate(p)
    assert not (tmp_path / "models").exists()
