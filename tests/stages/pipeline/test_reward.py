"""Stage `reward`: trains a one-output classifier from the SFT model; the quality gate stops the pipeline."""
import json

import pytest

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params


def test_reward_stage_outputs(built_pipeline):
    from transformers import AutoModelForSequenceClassification

    params, manifests = built_pipeline
    m = manifests["reward"]["metrics"]
    assert m["trained"] and m["steps"] == 3 and 0 <= m["accuracy"] <= 1
    assert m["train_pairs"] + m["held_out_pairs"] == 50 and m["held_out_pairs"] == 5  # reward.eval_fraction 0.1
    assert sum(row["count"] for row in m["table"]) == m["held_out_pairs"]  # the reliability table covers every pair
    folder = runner.output_dir(params, "reward")
    model = AutoModelForSequenceClassification.from_pretrained(folder / "model")
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    calibration = json.loads((folder / "calibration.json").read_text())
    assert calibration["accuracy"] == pytest.approx(m["accuracy"], abs=1e-4)


def test_quality_gate_fails_the_stage_and_blocks_downstream(tmp_path):
    params = load_params(write_params(tmp_path, {
        "data": {"builtin": {"num_preference": 200}},
        "reward": {"learning_rate": 1e-9, "max_steps": 1, "min_accuracy": 0.95}}))
    for stage in ("preprocess", "sft"):
        runner.run_stage(stage, params)
    with pytest.raises(runner.QualityGateFailed, match=r"held-out pair accuracy 0\.\d+ on 20 pairs \(\d+ right; "
                                                       r"one-sided 95% Wilson lower bound 0\.\d+\) is below "
                                                       r"reward\.min_accuracy = 0\.95\. 20 pairs cannot show an "
                                                       r"accuracy of 0\.95 at 95% confidence even if every pair is "
                                                       r"right: at least 52 are needed \(raise reward\.eval_fraction "
                                                       r"or give more pairs\)\. Nothing downstream runs"):
        runner.run_stage("reward", params)
    assert not runner.output_dir(params, "reward").exists()  # no half-accepted reward model
    with pytest.raises(runner.UpstreamMissing, match="'reward'"):
        runner.run_stage("score", params)


def test_split_pairs_is_deterministic_and_never_empty():
    from stages.pipeline.reward import split_pairs

    pairs = [{"i": i} for i in range(10)]
    train, held = split_pairs(pairs, 0.2, seed=0)
    assert len(held) == 2 and len(train) == 8 and split_pairs(pairs, 0.2, seed=0) == (train, held)
    assert sorted(r["i"] for r in train + held) == list(range(10))
    assert [len(x) for x in split_pairs(pairs[:2], 0.01, seed=0)] == [1, 1]
    with pytest.raises(ValueError, match="need at least 2"):
        split_pairs(pairs[:1], 0.1, seed=0)
