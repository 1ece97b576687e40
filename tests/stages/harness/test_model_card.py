"""Model cards (stages/harness/model_card.py) of every saved model folder, read back with huggingface_hub's
ModelCard.load."""
import dataclasses
import json

import pytest
from huggingface_hub import ModelCard

from stages.harness import artifacts, runner
from stages.harness.params_loader import load_params
from stages.pipeline import promote as promotion
from tests.conftest import write_params
from tests.pipelines import run_pipeline


def card(params, stage: str) -> ModelCard:
    return ModelCard.load(runner.output_dir(params, stage) / "model" / "README.md")


def fingerprints(params, *stages: str) -> dict:
    return {s: {"fingerprint": artifacts.read_manifest(runner.output_dir(params, s))["fingerprint"],
                "outputs_hash": artifacts.read_manifest(runner.output_dir(params, s))["outputs"]["hash"]}
            for s in stages}


def test_every_stage_model_has_a_card(built_pipeline):
    params, manifests = built_pipeline
    sft, reward, policy, merged = (card(params, s) for s in ("sft", "reward", "policy", "merge"))
    for c in (sft, reward, policy, merged):
        assert c.data.base_model == "builtin:tiny" and c.data.datasets == ["builtin:arithmetic"]
        assert c.data.library_name == "transformers" and "align" in c.data.tags
    assert sft.data.pipeline_tag == policy.data.pipeline_tag == merged.data.pipeline_tag == "text-generation"
    assert reward.data.pipeline_tag == "text-classification"  # a sequence classifier
    held_out = {r.metric_type: r.metric_value for r in reward.data.eval_results}  # the quality gate's figures
    assert held_out["accuracy"] == pytest.approx(manifests["reward"]["metrics"]["accuracy"], abs=1e-4)
    assert sft.data.align["params"]["sft.learning_rate"] == params.sft.learning_rate
    # the final evaluation on the validation rows: the eval table and model-index
    loss = {r.metric_type: r.metric_value for r in sft.data.eval_results}["loss"]
    assert loss == manifests["sft"]["metrics"]["eval_loss"] and "## Evaluation" in sft.text
    assert policy.data.tags == ["align", "policy", "dpo"] and policy.data.align["params"]["policy.dpo.beta"] == \
        params.policy.dpo.beta
    # lineage: every upstream stage with the fingerprint and outputs hash its manifest records
    assert sft.data.align["lineage"] == fingerprints(params, "preprocess")
    assert merged.data.align["lineage"] == fingerprints(params, "preprocess", "sft", "reward", "score", "reference",
                                                        "policy")
    assert merged.data.align["method"] == "dpo" and merged.data.model_name == "align-merge-dpo"
    assert merged.data.eval_results is None  # evaluated after merge: the promoted copy carries the table
    assert "| policy | `" + manifests["policy"]["fingerprint"][:16] in merged.text


def test_promoted_model_carries_the_eval_table_and_lineage(built_pipeline, tmp_path):
    params, manifests = built_pipeline
    p = dataclasses.replace(params, promote=dataclasses.replace(params.promote, models_dir=str(tmp_path / "models")))
    assert promotion.run_gate(p)["event"] == "promoted"
    production = tmp_path / "models" / "production"
    promoted = ModelCard.load(production / "README.md")
    row = manifests["evaluate"]["metrics"]["models"]["merged"]
    results = {r.metric_type: r.metric_value for r in promoted.data.eval_results}
    assert results["accuracy"] == row["accuracy"] and results["bleu"] == row["bleu"]
    assert {r.dataset_split for r in promoted.data.eval_results} == {"eval"}
    assert promoted.data.align["stage"] == "promoted" and promoted.data.align["method"] == "dpo"
    assert promoted.data.align["lineage"] == {**card(params, "merge").data.align["lineage"],
                                              **fingerprints(params, "merge", "evaluate")}
    merge_lineage = json.loads((runner.output_dir(params, "merge") / "lineage.json").read_text())
    assert json.loads((production / "lineage.json").read_text()) == merge_lineage
    assert "## Evaluation" in promoted.text and "| eval | accuracy |" in promoted.text
    print("\n".join(promoted.content.splitlines()[:30]))


def test_adapter_card_is_peft_and_byte_identical_on_rebuild(tmp_path):
    params = load_params(write_params(tmp_path, {"sft": {"lora": {"enabled": True, "r": 4}}}))
    run_pipeline(params, ("preprocess", "sft"))
    path = runner.output_dir(params, "sft") / "model" / "README.md"
    adapter = ModelCard.load(path)
    assert adapter.data.library_name == "peft" and adapter.data.tags == ["align", "sft", "lora"]
    assert adapter.data.align["params"]["sft.lora.r"] == 4 and "AutoPeftModelForCausalLM" in adapter.text
    before = path.read_bytes()
    assert runner.run_stage("sft", params, force=True)["executed"]
    assert path.read_bytes() == before  # no timestamps, no paths, no run names
