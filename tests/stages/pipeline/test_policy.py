"""Stage `policy`: every method runs from the SFT model on the built-in task and saves a loadable model."""
import json
import shutil

import pytest

from stages.harness import runner
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import write_params


def test_dpo_stage_outputs(built_pipeline):
    params, manifests = built_pipeline
    m = manifests["policy"]["metrics"]
    assert m["method"] == "dpo" and m["steps"] == 3 and m["rows"] == manifests["score"]["metrics"]["pairs"]
    assert "rewards/accuracies" in m["last"]
    assert "model/model.safetensors" in manifests["policy"]["outputs"]["files"]
    assert manifests["policy"]["inputs"]["sft"]["outputs_hash"] == manifests["sft"]["outputs"]["hash"]
    assert manifests["policy"]["inputs"]["reference"]["outputs_hash"] == manifests["reference"]["outputs"]["hash"]


@pytest.mark.parametrize("method, logged", [
    ("kto", "kl"), ("online_dpo", "win_rate"), ("grpo", "frac_reward_zero_std"), ("ppo", "explained_variance"),
    ("rloo", "clip_ratio/region_mean"), ("distillation", "divergence")])
def test_every_method_trains_from_sft(tmp_path, built_pipeline, method, logged):
    from transformers import AutoModelForCausalLM

    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")  # its own copy: other tests read the original
    extra = {"policy": {"method": method, method: {"per_device_train_batch_size": 4}}}
    if method in ("online_dpo", "ppo"):  # the tiny reward model of the small settings, and a rule reward
        extra["policy"][method].update(reward_functions=["reward_model", "exact_match"], reward_weights=[1.0, 1.0])
    if method in ("grpo", "rloo"):  # the small SFT model is never right: a reward that varies within a group
        extra["policy"][method] = {"reward_functions": ["exact_match",
                                                        "tests.stages.pipeline.user_rewards:distinct_tokens"]}
    if method == "distillation":  # the untrained base as the teacher: the same tokenizer, other distributions
        extra["policy"][method]["teacher_model_name_or_path"] = "builtin:tiny"
    p = load_params(write_params(tmp_path, extra))
    assert runner.run_stage("reference", p)["metrics"] == {"computed": False, "reason": f"policy.method = {method}"}
    m = runner.run_stage("policy", p)["metrics"]
    assert m["method"] == method and m["steps"] == 3 and m["train_loss"] == m["train_loss"]  # not NaN
    assert any(k.endswith(logged) for k in m["last"]), m["last"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "artifacts" / "policy" / "model")
    sft = AutoModelForCausalLM.from_pretrained(tmp_path / "artifacts" / "sft" / "model")
    changed = [n for n, w in model.state_dict().items() if not (w == sft.state_dict()[n]).all()]
    assert changed, "the policy's weights equal the SFT model's"
    if method == "ppo":
        assert (tmp_path / "artifacts" / "policy" / "model" / "value_head.safetensors").exists()


def test_a_teacher_with_another_tokenizer_is_refused_by_its_key(tmp_path, built_pipeline):
    from stages.builtin import tiny

    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")
    other = tiny.build(tmp_path / "other", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                       vocab_size=320, seed=0)
    p = load_params(write_params(tmp_path, {"policy": {"method": "distillation", "distillation": {
        "teacher_model_name_or_path": str(other)}}}))
    runner.run_stage("reference", p)
    with pytest.raises(ValueError, match=r"policy\.distillation\.teacher_model_name_or_path = .*its tokenizer "
                                         r"differs from the student's"):
        runner.run_stage("policy", p)
    with pytest.raises(ParamsError, match=r"policy\.distillation\.teacher_model_name_or_path = null"):
        load_params(write_params(tmp_path, {"policy": {"method": "distillation"}}))


def test_no_preference_pairs_is_a_clear_error(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                                              for i in range(60)))
    # found when the params are validated, before anything is trained (stages.data.sources.needs)
    with pytest.raises(ParamsError, match=r"policy\.data = preprocess, but the data has no preference rows for "
                                          r"policy\.method = dpo: set --set policy\.method=grpo "
                                          r"--set score\.enabled=false \(GRPO learns from the rule reward on every "
                                          r"sample\), or --set policy\.data=score"):
        load_params(write_params(tmp_path, {"data": {"source": str(tmp_path / "d.jsonl")},
                                            "score": {"enabled": False}, "policy": {"data": "preprocess"}}))


def test_beta_only_rerun_runs_no_reference_forward(tmp_path, built_pipeline):
    from stages.trainers import reference_model as reference

    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")
    p = load_params(write_params(tmp_path, {"policy": {"dpo": {"beta": 0.5}}}))  # not the default (0.3)
    before = reference.REFERENCE_FORWARDS
    assert runner.run_stage("reference", p)["executed"] is False  # beta is not an input of the log-probs
    m = runner.run_stage("policy", p)
    assert m["executed"] and m["metrics"]["steps"] == 3
    assert reference.REFERENCE_FORWARDS == before  # the reference model never ran
