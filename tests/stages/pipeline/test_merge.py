"""Stage merge: a full policy model re-saved, a LoRA policy adapter merged (with extra adapters), bad inputs."""
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from stages import adapter_merge
from stages.adapter_merge import MergeError
from stages.harness import runner
from stages.harness.params_loader import ParamsError, load_params
from stages.harness.runner import StageContext
from stages.models import load_tokenizer
from stages.pipeline import merge as merge_stage
from tests.conftest import write_params
from tests.stages.test_adapter_merge import make_adapter


def weights(path):
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(str(path)).state_dict().items()}


def test_full_policy_model_is_resaved_without_extras(built_pipeline, tmp_path):
    params, manifests = built_pipeline
    m = manifests["merge"]["metrics"]
    assert (m["merged"], m["method"], m["source"]) == (False, "none", "policy")
    out = runner.output_dir(params, "merge") / "model"
    assert weights(out).keys() == weights(runner.output_dir(params, "policy") / "model").keys()
    for k, v in weights(out).items():
        assert torch.equal(v, weights(runner.output_dir(params, "policy") / "model")[k]), k
    assert m["lineage"]["output_hash"].startswith("sha256:")

    # PPO leaves value_head.safetensors next to the LM: the merged folder is a plain causal LM without it
    policy = tmp_path / "policy"
    shutil.copytree(runner.output_dir(params, "policy"), policy)
    save_file({"v_head.summary.weight": torch.ones(1, 32)}, str(policy / "model" / "value_head.safetensors"))
    ctx = StageContext(params=params, out=tmp_path / "out",
                       inputs={"preprocess": runner.output_dir(params, "preprocess"),
                               "sft": runner.output_dir(params, "sft"), "policy": policy}, log=logging.getLogger("t"),
                       work=tmp_path / "work", stage="merge")
    ctx.out.mkdir()
    merge_stage.run(ctx)
    files = {p.name for p in (ctx.out / "model").iterdir()}
    assert "value_head.safetensors" not in files and "training_args.bin" not in files
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= files


@pytest.fixture(scope="module")
def lora_run(built_pipeline, tmp_path_factory):
    """The small pipeline's outputs with a LoRA policy: only reference (its fingerprint holds the policy's
    LoRA and quantization settings), policy (and merge) run again."""
    params, _ = built_pipeline
    folder = tmp_path_factory.mktemp("lora")
    shutil.copytree(params.run.output_dir, folder / "artifacts")
    lora = {"policy": {"dpo": {"lora": {"enabled": True, "r": 4}, "learning_rate": 0.01}}}
    p = load_params(write_params(folder, lora))
    runner.run_stage("reference", p)
    policy = runner.run_stage("policy", p)
    assert policy["executed"] and adapter_merge.is_adapter(runner.output_dir(p, "policy") / "model")
    return folder, lora, p


def test_lora_policy_adapter_is_merged_exactly(lora_run):
    folder, lora, p = lora_run
    manifest = runner.run_stage("merge", p)
    m = manifest["metrics"]
    print(f"merge stage, LoRA policy adapter: logits max diff {m['logits_max_diff']:.3g}")
    assert m["merged"] and m["logits_max_diff"] < 1e-4
    sft, adapter = runner.output_dir(p, "sft") / "model", runner.output_dir(p, "policy") / "model"
    lineage = json.loads((runner.output_dir(p, "merge") / "lineage.json").read_text())
    # relative to run.output_dir: the same params in another folder give the same lineage.json
    assert lineage["base"]["path"] == "sft/model" and lineage["adapters"][0]["path"] == "policy/model"
    assert lineage["adapters"][0]["weight"] == 1.0 and lineage["adapters"][0]["hash"].startswith("sha256:")
    # the merged folder reproduces the adapter model (on its pipeline base) after a round trip
    tok = load_tokenizer(str(sft))
    probe = adapter_merge.probe_batch(tok, ["<|user|>\n12+34<|end|><|assistant|>\n", "<|user|>\n99+1<|end|>"])
    reloaded = AutoModelForCausalLM.from_pretrained(str(runner.output_dir(p, "merge") / "model"))
    expected = adapter_merge.probe_logits(adapter_merge.load_adapter_model(str(sft), str(adapter)), probe)
    assert adapter_merge.max_abs_diff(adapter_merge.probe_logits(reloaded, probe), expected) < 1e-4
    assert adapter_merge.max_abs_diff(adapter_merge.probe_logits(AutoModelForCausalLM.from_pretrained(str(sft)), probe),
                              expected) > 0  # the adapter did change the model


def test_extra_adapters_weights_and_bases(lora_run, tmp_path):
    folder, lora, p = lora_run
    sft = runner.output_dir(p, "sft") / "model"
    same_base = make_adapter(sft, tmp_path / "task", r=4, seed=5)
    extra = {**lora, "merge": {"adapters": [same_base], "weights": [1.0, 0.5], "combination": "cat"}}
    m = runner.run_stage("merge", load_params(write_params(folder, extra)))["metrics"]
    assert m["adapters"] == 2 and m["logits_max_diff"] < 1e-4 and m["change_max_diff"] > 1e-3
    assert [a["weight"] for a in m["lineage"]["adapters"]] == [1.0, 0.5]

    with pytest.raises(ParamsError, match=r"merge.weights = \[1.0\]: 1 weight\(s\) for 2 adapter"):
        load_params(write_params(folder, {**lora, "merge": {"adapters": [same_base], "weights": [1.0]}}))
    with pytest.raises(ParamsError, match=r"merge.prune_fraction = 1.0: must be in \[0, 1\)"):
        load_params(write_params(folder, {"merge": {"prune_fraction": 1.0}}))
    base = runner.output_dir(p, "builtin")  # the raw base model is not the policy adapter's base (the SFT model)
    foreign = make_adapter(next(d for d in base.iterdir() if d.is_dir()), tmp_path / "foreign", r=4, seed=6)
    bad = load_params(write_params(folder, {**lora, "merge": {"adapters": [foreign]}}))
    with pytest.raises(MergeError, match=r"different bases: the policy stage's adapter on .*merge.adapters\[0\]"):
        runner.run_stage("merge", bad)
