"""Scale-out settings that cannot work stop before anything is launched or trained, naming the key:
a sharding engine (FSDP, DeepSpeed) without CUDA, and LoRA on layers the model does not have."""
from __future__ import annotations

import pytest
import torch

from tests.bad_inputs.conftest import assert_rejected

LAYERS = r"\['down_proj', 'embed_tokens', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"


@pytest.mark.parametrize("config, engine, device", [
    pytest.param("fsdp", "FSDP", "auto", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here")),
    ("deepspeed_zero3", "DeepSpeed", "cpu"),
])
def test_sharding_engine_without_cuda_stops_before_launch(capsys, params_for, config, engine, device):
    """Checked first, before the upstream stages (preprocess has not run here) and before any process starts."""
    params = params_for({"run": {"device": device, "launch": {
        "num_processes": 2, "accelerate_config": f"configs/accelerate/{config}.yaml"}}})
    why = "none is visible" if device == "auto" else r"run\.device = cpu"
    assert_rejected(capsys, params, "sft", rf"run\.launch\.accelerate_config = configs/accelerate/{config}\.yaml: "
                    rf"{engine} needs CUDA GPUs and {why}; use configs/accelerate/ddp\.yaml", code=1)
    assert not list((params.parent / "artifacts").glob(".work/launch-*")), "a launch was prepared"


def test_lora_on_layers_the_model_lacks(capsys, params_for):
    """Found in params validation (exit 2) on the model's skeleton, for every section at once; a target that
    ends a layer's full name (self_attn.v_proj), as PEFT matches it, is accepted."""
    params = params_for({"sft": {"lora": {"enabled": True, "target_modules": ["q_proj", "qkv", "attn.c_proj"]}},
                         "reward": {"lora": {"enabled": True, "target_modules": ["self_attn.v_proj", "score", "w1"]}}})
    err = assert_rejected(
        capsys, params, "sft",
        r"sft\.lora\.target_modules = \['q_proj', 'qkv', 'attn\.c_proj'\]: \['qkv', 'attn\.c_proj'\] name no layer "
        r"of LlamaForCausalLM .*; the layers LoRA can adapt are " + LAYERS,
        r"reward\.lora\.target_modules = \['self_attn\.v_proj', 'score', 'w1'\]: \['w1'\] name no layer of "
        r"LlamaForSequenceClassification .* can adapt are \[.*'score'", code=2)
    assert "use [all-linear]" in err
