"""AutoModelForCausalLMWithValueHead: shapes, save/load round trips (plain and PEFT), fresh heads."""
import json

import pytest
import torch

from stages.trainers.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead
from tests.stages.trainers.conftest import build_tiny


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), num_heads=4)


def _inputs():
    ids = torch.randint(5, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    return ids, mask


def _randomise_head(model):
    with torch.no_grad():
        model.v_head.weight.normal_(generator=torch.Generator().manual_seed(1))
        model.v_head.bias.fill_(0.3)


def test_forward_shapes_and_logits_free_path(path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(path).eval()
    ids, mask = _inputs()
    logits, hidden, values = model(ids, attention_mask=mask)
    assert logits.shape == (3, 9, model.config.vocab_size) and hidden.shape == (3, 9, 32) and values.shape == (3, 9)
    assert values.dtype == torch.float32
    # the fresh head starts near zero: values small against the unit-scale hidden states
    assert values.abs().max() < 0.05 and model.v_head.bias.abs().max() == 0
    none, hidden2, values2 = model(ids, attention_mask=mask, return_logits=False)
    assert none is None and torch.equal(hidden, hidden2) and torch.equal(values, values2)
    # the LM head on the wrapper's hidden states gives the wrapper's logits (hidden is after the final norm)
    assert torch.allclose(model.get_output_embeddings()(hidden), logits, atol=1e-5)


def test_save_and_reload_give_identical_logits_and_values(path, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(path).eval()
    _randomise_head(model)
    ids, mask = _inputs()
    logits, _, values = model(ids, attention_mask=mask)
    model.save_pretrained(tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert VALUE_HEAD_FILE in files and "model.safetensors" in files and not [f for f in files if f.endswith(".bin")]
    again = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "out").eval()
    logits2, _, values2 = again(ids, attention_mask=mask)
    assert torch.equal(logits, logits2) and torch.equal(values, values2)
    assert values.abs().max() > 0.1  # the randomised head, not a fresh one, came back


def test_saved_folder_is_still_a_plain_causal_lm(path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLMWithValueHead.from_pretrained(path).eval()
    model.save_pretrained(tmp_path / "out")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask = _inputs()
    assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits, model(ids, attention_mask=mask)[0])


def test_peft_round_trip_merges_the_adapter_and_keeps_the_head(path, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lm = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model = AutoModelForCausalLMWithValueHead(lm).eval()
    assert model.is_peft_model and model.v_head.weight.requires_grad
    _randomise_head(model)
    ids, mask = _inputs()
    logits, _, values = model(ids, attention_mask=mask)
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    again = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "adapter").eval()
    assert not again.is_peft_model  # load_causal_lm merged the adapter into its base
    logits2, _, values2 = again(ids, attention_mask=mask)
    assert torch.allclose(logits, logits2, atol=1e-5) and torch.allclose(values, values2, atol=1e-5)


def test_foreign_head_file_is_refused(path, tmp_path):
    from safetensors.torch import save_file

    model = AutoModelForCausalLMWithValueHead.from_pretrained(path)
    model.save_pretrained(tmp_path / "out")
    save_file({"score.weight": torch.zeros(1, 32)}, str(tmp_path / "out" / VALUE_HEAD_FILE))
    with pytest.raises(ValueError, match="holds \\['score.weight'\\], expected \\['v_head.bias', 'v_head.weight'\\]"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "out")
