"""Stage `reference`: reference log-probs of the DPO pairs, computed once, only when DPO needs them."""
from stages import runner
from stages.data import read_jsonl


def test_reference_logps_cover_every_pair(built_pipeline):
    params, manifests = built_pipeline
    m = manifests["reference"]["metrics"]
    assert m["computed"] and m["source"] == "score"
    rows = read_jsonl(runner.output_dir(params, "reference") / "pairs.jsonl")
    pairs = read_jsonl(runner.output_dir(params, "score") / "pairs.jsonl")
    assert len(rows) == len(pairs) == m["pairs"] > 0
    for row, pair in zip(rows, pairs):
        assert row["chosen"] == pair["chosen"] and row["rejected"] == pair["rejected"]
        assert row["ref_chosen_logps"] < 0 and row["ref_rejected_logps"] < 0  # summed log-probs of real tokens


def test_nothing_to_compute_for_other_methods():
    from stages.config import PolicyParams
    from stages.pipeline.reference import needed

    assert needed(PolicyParams()) is None
    assert needed(PolicyParams(method="grpo")) == "policy.method = grpo"
    p = PolicyParams()
    p.dpo.precompute_ref_log_probs = False
    assert "precompute_ref_log_probs = false" in needed(p)
