"""stages.adapter_merge: exact single-adapter merges, weighted and sequential merging, pruning, bad inputs."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages import adapter_merge
from stages.adapter_merge import AdapterSpec, MergeError
from stages.builtin import tiny
from stages.models import load_tokenizer

TEXTS = ["<|user|>\n12+34<|end|><|assistant|>\n<think>2+4=6, 1+3=4</think>46<|end|>", "<|user|>\n7+8<|end|>",
         "<|assistant|>\n<think>9+9=18</think>118"]
SIZE = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=384)


def make_adapter(base, folder, *, r=4, seed=0, targets="all-linear"):
    """A LoRA adapter with random (non-zero) A and B, as training would leave it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = tiny.build(root / "base", **SIZE, seed=0)
    other = tiny.build(root / "other", **SIZE, seed=1)
    tok = load_tokenizer(str(base))
    return {"base": str(base), "other": str(other), "tok": tok, "probe": adapter_merge.probe_batch(tok, TEXTS),
            "a": make_adapter(base, root / "a", seed=1), "b": make_adapter(base, root / "b", seed=2),
            "c": make_adapter(base, root / "c", r=2, seed=3), "foreign": make_adapter(other, root / "f", seed=4),
            "root": root}


def test_single_adapter_merge_reproduces_adapter_logits_and_round_trips(setup, tmp_path):
    s = setup
    adapter_model = adapter_merge.load_adapter_model(s["base"], s["a"])
    expected = adapter_merge.probe_logits(adapter_model, s["probe"])
    base_logits = adapter_merge.probe_logits(AutoModelForCausalLM.from_pretrained(s["base"]), s["probe"])
    assert adapter_merge.max_abs_diff(expected, base_logits) > 1e-2  # the adapter changes the model: the test can fail

    model, report = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"])], probe=s["probe"], tolerance=1e-4)
    print(f"single LoRA merge: logits max diff {report['logits_max_diff']:.3g}")
    assert report["logits_max_diff"] < 1e-4
    assert report["change_max_diff"] < 1e-4
    adapter_merge.save_merged(model, s["tok"], tmp_path / "merged")
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert "model.safetensors" in files and "adapter_config.json" not in files and "chat_template.jinja" in files
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    assert adapter_merge.max_abs_diff(adapter_merge.probe_logits(reloaded, s["probe"]), expected) < 1e-4


def test_weight_scales_the_update_exactly(setup):
    s = setup
    base = adapter_merge.probe_logits(AutoModelForCausalLM.from_pretrained(s["base"]), s["probe"])
    half, _ = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"], 0.5)])
    full, _ = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"], 1.0)])
    zero, _ = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"], 0.0)])
    assert adapter_merge.max_abs_diff(adapter_merge.probe_logits(zero, s["probe"]), base) < 1e-5
    w_half = dict(half.named_parameters())
    w_full = dict(full.named_parameters())
    w_base = dict(AutoModelForCausalLM.from_pretrained(s["base"]).named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(w_half[name] - w_base[name], 0.5 * (w_full[name] - w_base[name]), atol=1e-6, rtol=1e-4)


def test_weighted_merge_of_two_adapters(setup):
    s = setup
    specs = [AdapterSpec(s["a"], 0.7), AdapterSpec(s["b"], 0.3)]
    cat, report = adapter_merge.merge_adapters(s["base"], specs, combination="cat", probe=s["probe"])
    assert report["combination"] == "cat" and report["logits_max_diff"] < 1e-4
    assert report["change_max_diff"] > 1e-3  # b moved the model away from a alone
    # cat is exact: W + 0.7 ΔA + 0.3 ΔB, weight by weight
    wa = dict(adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"])])[0].named_parameters())
    wb = dict(adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["b"])])[0].named_parameters())
    w0 = dict(AutoModelForCausalLM.from_pretrained(s["base"]).named_parameters())
    got = dict(cat.named_parameters())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        want = w0[name] + 0.7 * (wa[name] - w0[name]) + 0.3 * (wb[name] - w0[name])
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-4)
    for combination in ("linear", "ties", "dare_ties", "svd"):
        model, rep = adapter_merge.merge_adapters(s["base"], specs, combination=combination, density=0.5,
                                                  probe=s["probe"])
        assert rep["logits_max_diff"] < 1e-4, combination  # the merge reproduces the combined adapter model
        assert torch.isfinite(adapter_merge.probe_logits(model, s["probe"])).all()


def test_sequential_composition_equals_merging_one_after_the_other(setup):
    s = setup
    chained, report = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"]), AdapterSpec(s["c"], 2.0)],
                                           combination="sequential", probe=s["probe"])
    assert report["method"] == "sequential" and report["logits_max_diff"] < 1e-4
    cat, _ = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"]), AdapterSpec(s["c"], 2.0)], combination="cat")
    # two adapters of one base, chained: the same sum of updates as cat
    assert adapter_merge.max_abs_diff(adapter_merge.probe_logits(chained, s["probe"]),
                                      adapter_merge.probe_logits(cat, s["probe"])) < 1e-4


@pytest.mark.parametrize("method,fraction", [("magnitude", 0.5), ("magnitude", 0.9), ("rank", 0.5)])
def test_pruning_measures_what_it_removed(setup, method, fraction):
    s = setup
    model, report = adapter_merge.merge_adapters(s["base"], [AdapterSpec(s["a"])], prune_fraction=fraction,
                                         prune_method=method, probe=s["probe"])
    p = report["prune"]
    print(f"prune {method} {fraction}: measured {p['pruned_fraction']}, energy removed {p['energy_removed']}")
    assert p["pruned_fraction"] == pytest.approx(fraction, abs=0.01)
    assert 0 < p["energy_removed"] < fraction  # the smallest entries/directions carry less than their share
    assert report["logits_max_diff"] < 1e-4  # the pruned adapter model is what got merged
    assert report["change_max_diff"] > 1e-4  # pruning changed the model
    if method == "rank":
        assert (p["rank_before"], p["rank_after"]) == (4, 2)
        w0 = dict(AutoModelForCausalLM.from_pretrained(s["base"]).named_parameters())
        name = "model.layers.0.mlp.up_proj.weight"
        delta = dict(model.named_parameters())[name] - w0[name]
        assert torch.linalg.matrix_rank(delta.detach(), atol=1e-5) == 2
    else:
        w0 = dict(AutoModelForCausalLM.from_pretrained(s["base"]).named_parameters())
        name = "model.layers.0.mlp.up_proj.weight"
        delta = dict(model.named_parameters())[name] - w0[name]
        assert float((delta == 0).float().mean()) == pytest.approx(fraction, abs=0.01)


def test_bad_inputs_fail_before_loading(setup, tmp_path):
    s = setup
    with pytest.raises(MergeError, match="different bases"):
        adapter_merge.check_adapters([AdapterSpec(s["a"], label="merge.adapters[0]"),
                              AdapterSpec(s["foreign"], label="merge.adapters[1]")], combination="cat")
    with pytest.raises(MergeError, match=r"merge.weights = \[1.0\]: 1 weight\(s\) for 2 adapter"):
        adapter_merge.pair_weights([s["a"], s["b"]], [1.0])
    for fraction in (1.0, -0.1):
        with pytest.raises(MergeError, match=r"merge.prune_fraction = .*must be in \[0, 1\)"):
            adapter_merge.check_adapters([AdapterSpec(s["a"])], prune_fraction=fraction)
    with pytest.raises(MergeError, match="not a PEFT adapter folder"):
        adapter_merge.check_adapters([AdapterSpec(s["base"], label="merge.adapters[0]")])
    with pytest.raises(MergeError, match="one of linear, cat"):
        adapter_merge.check_adapters([AdapterSpec(s["a"])], combination="average")
    with pytest.raises(MergeError, match="needs adapters of one rank"):
        adapter_merge.check_adapters([AdapterSpec(s["a"]), AdapterSpec(s["c"])], combination="linear")
    with pytest.raises(MergeError, match="needs a density"):
        adapter_merge.check_adapters([AdapterSpec(s["a"]), AdapterSpec(s["b"])], combination="ties")
    # a copy of the base at another path is the same base: identity is by content, not by path
    import shutil

    copy = shutil.copytree(s["b"], tmp_path / "b-copy")
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(shutil.copytree(s["base"], tmp_path / "base-copy"))
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    assert len(adapter_merge.check_adapters([AdapterSpec(s["a"]), AdapterSpec(str(copy))], combination="cat")) == 2
