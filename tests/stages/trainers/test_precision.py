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


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_cached_casts_samples_as_per_forward_autocast_and_casts_each_weight_once(tmp_path):
    """A bf16 trainer generates with its forward under autocast (accelerate's wrapping, here `wrap_forward`). With
    `precision="bf16"` the whole call is one autocast region: the completions and their log-probs are exactly
    those of per-forward autocast, and the weights are cast once per call instead of once per decode step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.trainers.online_sampling import GenerationParams, sample_online
    from stages.trainers.precision import wrap_forward
    from tests.stages.trainers.conftest import build_tiny, builtin_rows

    path = build_tiny(tmp_path / "model")
    model = wrap_forward(AutoModelForCausalLM.from_pretrained(path), "bf16")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_preference=3)]
    g = GenerationParams(max_new_tokens=8)

    per_forward = sample_online(model, tok, prompts, g, n=2, seed=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_online(model, tok, prompts, g, n=2, seed=3)
    per_forward_casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    cached = sample_online(model, tok, prompts, g, n=2, seed=3, precision="bf16")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_online(model, tok, prompts, g, n=2, seed=3, precision="bf16")
    cached_casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    assert cached.completion_ids == per_forward.completion_ids
    assert cached.logprobs == per_forward.logprobs
    weights = sum(1 for p in model.parameters() if p.dim() == 2) - 1  # the embedding is looked up, not cast
    assert per_forward_casts - cached_casts >= weights * (g.max_new_tokens - 2)
    assert not torch.is_autocast_enabled("cpu")
