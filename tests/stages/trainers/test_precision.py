"""stages.trainers.precision: which autocast a stage trains under, and a forward run the way a Trainer runs it."""
import pytest
import torch

from stages.trainers.logprobs import lm_head_for_chunking
from stages.trainers.precision import autocast_forward, mixed_precision


def test_auto_keeps_fp32_on_cpu_and_bf16_runs_there():
    assert mixed_precision("auto", "cpu", "policy") == "no"
    assert mixed_precision("bf16", "cpu", "policy") == "bf16"
    assert mixed_precision("no", "cpu", "policy") == "no"
    with pytest.raises(ValueError, match=r"reward\.mixed_precision = 'fp16' needs a GPU; this run is on cpu: use bf16"):
        mixed_precision("fp16", "cpu", "reward")


def test_autocast_forward_is_the_trainers_and_is_undone():
    """Inside: the forward computes in bf16 (its logits differ from fp32) and returns fp32, with the forward's
    signature kept (the chunked log-prob path reads `logits_to_keep` from it: without the signature it would
    silently take the logits path, other numerics than the Trainer's); outside: the model is as before."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        fp32 = model(input_ids=ids).logits
        with autocast_forward(model, "bf16") as wrapped:
            assert lm_head_for_chunking(wrapped) is model.lm_head
            bf16 = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)
    assert (bf16 - fp32).abs().max() < 0.05  # bf16 rounding, not another model
    assert "forward" not in vars(model) and torch.equal(after, fp32)
