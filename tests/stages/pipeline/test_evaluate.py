import re

from stages import runner
from stages.data import read_jsonl
from stages.pipeline.evaluate import after_reasoning, extract


def test_table_has_baseline_and_sft_rows(built_pipeline):
    params, manifests = built_pipeline
    table = manifests["evaluate"]["metrics"]["table"]
    assert [r["model"] for r in table] == ["base", "sft", "policy"]
    preds = read_jsonl(runner.output_dir(params, "evaluate") / "predictions.jsonl")
    assert len(preds) == 3 * 20
    for label in ("base", "sft", "policy"):
        rows = [p for p in preds if p["model"] == label]
        acc = sum(p["correct"] for p in rows) / len(rows)
        assert abs(acc - next(r["accuracy"] for r in table if r["model"] == label)) < 1e-3


def test_extract_answer():
    pat = re.compile(r"(-?\d+)\s*$")
    assert extract("132", pat) == "132"
    assert extract("<think>7+5=12</think>132", pat) == "132"
    assert extract("<think>7+5=12", pat) is None  # never closed: no answer
    assert extract("the answer is", pat) is None
    assert extract("  Paris ", None) == "Paris"
    assert after_reasoning("a</think>b</think>c") == "c"
