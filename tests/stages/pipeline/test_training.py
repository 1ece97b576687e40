"""stages.pipeline.training: mixed precision, activation checkpointing and QLoRA, the same for every training
stage (`sft`, `reward`, `policy`), from the keys each section shares (stages.harness.config.PrecisionParams)."""
import shutil

import pytest
import torch

from stages.harness import runner
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import write_params


def _copy(built_pipeline, tmp_path, extra):
    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")  # its own copy: other tests read the original
    return params, load_params(write_params(tmp_path, extra))


def _changed(before: dict, after: dict) -> list[str]:
    return [n for n, w in after.items() if n in before and not torch.equal(w, before[n])]


@pytest.mark.slow
def test_reward_and_lora_policy_train_under_bf16_with_checkpointing(tmp_path, built_pipeline):
    """reward (full) and policy (LoRA DPO) accept the keys and train a step: bf16 autocast over fp32 master
    weights, every decoder block checkpointed (the policy's LoRA + checkpointing needs input grads)."""
    from safetensors.torch import load_file

    keys = {"mixed_precision": "bf16", "gradient_checkpointing": True, "gradient_checkpointing_every": 1,
            "max_steps": 1, "warmup_steps": 0.0}  # no warm-up: the one step moves the weights
    params, p = _copy(built_pipeline, tmp_path, {"policy": {"dpo": {**keys, "lora": {"enabled": True}}}})
    expected = {"mixed_precision": "bf16", "gradient_checkpointing": True, "trained_weights_dtype": "float32"}
    assert runner.run_stage("reference", p)["metrics"]["mixed_precision"] == "bf16"
    m = runner.run_stage("policy", p)["metrics"]
    assert m["precision"] == expected and m["steps"] == 1, m
    # then the reward model (params of its own: a rebuilt reward model makes score, so the policy's pairs, stale)
    p = load_params(write_params(tmp_path, {"reward": keys}))
    m = runner.run_stage("reward", p)["metrics"]
    assert m["precision"] == expected and m["steps"] == 1, m
    for stage, weights in (("policy", "model/adapter_model.safetensors"), ("reward", "model/model.safetensors")):
        saved = load_file(runner.output_dir(p, stage) / weights)
        assert {w.dtype for w in saved.values()} == {torch.float32}, stage  # saved from the fp32 master weights
    reward_before = load_file(runner.output_dir(params, "reward") / "model" / "model.safetensors")
    assert _changed(reward_before, load_file(runner.output_dir(p, "reward") / "model" / "model.safetensors"))
    adapter = load_file(runner.output_dir(p, "policy") / "model" / "adapter_model.safetensors")
    assert any(n.endswith("lora_B.weight") and w.abs().max() > 0 for n, w in adapter.items())  # B left 0: trained


def test_qlora_refused_before_loading_without_cuda(tmp_path, built_pipeline):
    """QLoRA on CPU: each stage stops before loading, naming its own key, and leaves its previous output as it
    was; never plain LoRA on an unquantized model instead (from the SFT adapter folder too, where the
    adapter used to be merged at full precision and the quantization dropped). A quantization without LoRA
    is a params error."""
    from stages.pipeline import training

    def refused(key: str, value: str) -> str:
        return rf"^{key}\.lora\.quantization = '{value}': QLoRA needs a CUDA GPU .* set {key}\.lora\.quantization: none"

    qlora = {"enabled": True, "quantization": "4bit"}
    _, p = _copy(built_pipeline, tmp_path, {"policy": {"dpo": {"lora": qlora}}})
    live = load_params(write_params(tmp_path, {"policy": {"dpo": {"lora": qlora, "precompute_ref_log_probs": False}}}))
    for stage, params in (("reference", p), ("policy", live)):  # the reference of a QLoRA policy: its 4-bit base
        manifest = runner.output_dir(p, stage) / "manifest.json"
        before = manifest.read_text()  # the copied pipeline's output, built without QLoRA
        with pytest.raises(ValueError, match=refused(r"policy\.dpo", "4bit")):
            runner.run_stage(stage, params)
        assert manifest.read_text() == before  # nothing written over it
        if stage == "reference":
            assert not runner.run_stage("reference", live)["metrics"]["computed"]  # live reference: none to compute

    p = load_params(write_params(tmp_path, {"sft": {"lora": {"enabled": True}, "max_steps": 1},
                                            "reward": {"lora": {**qlora, "quantization": "8bit"}},
                                            "policy": {"dpo": {"lora": qlora}}}))
    runner.run_stage("sft", p)
    adapter = runner.output_dir(p, "sft") / "model"
    assert (adapter / "adapter_config.json").exists()
    with pytest.raises(ValueError, match=refused("reward", "8bit")):
        runner.run_stage("reward", p)
    with pytest.raises(ValueError, match=refused(r"policy\.dpo", "4bit")):  # the policy stage's loader, same folder
        training.load_trainable_model(str(adapter), p, p.policy.dpo, device="cpu", section="policy.dpo")
    with pytest.raises(ParamsError, match=r"policy\.dpo\.lora\.quantization = '4bit' with lora\.enabled = false"):
        load_params(write_params(tmp_path, {"policy": {"dpo": {"lora": {"quantization": "4bit"}}}}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qlora_from_an_adapter_folder_merges_then_quantizes(tmp_path):
    """An adapter folder loaded for QLoRA: the adapter merged at full precision, then the merged model loaded in
    4 bits (its Linear layers are bitsandbytes' Linear4bit); its logits are the merged model's within 4-bit
    rounding, nearer to them than to the base's (the adapter was not dropped)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages.harness.config import LoraParams
    from stages.models import load_causal_lm
    from stages.trainers.adapters import quantization_config
    from tests.stages.trainers.conftest import build_tiny

    base = build_tiny(tmp_path / "base", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear",
                                                                                  init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    merged = peft.merge_and_unload().cuda().eval()
    plain = AutoModelForCausalLM.from_pretrained(base).cuda().eval()
    config = quantization_config(LoraParams(enabled=True, quantization="4bit"), device="cuda")
    model = load_causal_lm(str(tmp_path / "adapter"), device="cuda", quantization_config=config).eval()
    assert model.is_loaded_in_4bit
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]], device="cuda")
    with torch.no_grad():
        want, got, base_logits = (m(input_ids=ids).logits.float() for m in (merged, model, plain))
    assert (got - want).abs().mean() < (got - base_logits).abs().mean()
    assert model.name_or_path == str(tmp_path / "adapter")
