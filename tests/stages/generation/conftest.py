"""A built-in tiny model whose greedy outputs depend on the prompt (weights scaled up x5, so
the logits are peaked rather than the near-uniform ones of a fresh 0.02-std init)."""
import pytest
import torch

from stages.builtin import tiny

PROMPTS = [[{"role": "user", "content": c}] for c in ["1+2", "47+85", "123+4567", "9+99999", "3+4", "12+34",
                                                      "5555+6", "0+0"]] + ["plain 7+8", "2+2="]


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tiny.build(tmp_path_factory.mktemp("gen-tiny"), hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, vocab_size=384, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
    model.save_pretrained(path)
    return path


@pytest.fixture
def model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path)


@pytest.fixture
def tok(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)
