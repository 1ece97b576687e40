"""stages.precision: which autocast a stage trains under, and a forward run the way a Trainer runs it."""
import pytest
import torch

from stages.logprobs import lm_head_for_chunking
from stages.precision import autocast_forward, mixed_precision


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
@pytest.mark.parametrize("decoder", [False, True])
def test_cached_casts_samples_as_per_forward_autocast_and_casts_each_weight_once(tmp_path, monkeypatch, decoder):
    """A bf16 trainer generates with its forward under autocast (accelerate's wrapping, here `wrap_forward`). With
    `precision="bf16"` the whole call is one autocast region: with HF's generate the completions and their
    log-probs are exactly those of per-forward autocast; the lean decoder (which skips a wrapped forward only
    inside such a region) gives the same completions, its log-probs within bf16 rounding of another op order.
    Either way the weights are cast once per call instead of once per decode step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation.decoder import Decoder
    from stages.sampling import SamplingParams
    from stages.trainers.online_generation import sample_online

    if not decoder:
        monkeypatch.setattr(Decoder, "for_model", classmethod(lambda cls, model, capacity: None))
    from stages.precision import wrap_forward
    from tests.stages.trainers.conftest import build_tiny, builtin_rows

    path = build_tiny(tmp_path / "model")
    model = wrap_forward(AutoModelForCausalLM.from_pretrained(path), "bf16")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_preference=3)]
    g = SamplingParams(max_new_tokens=8, n=2, do_sample=True)

    per_forward = sample_online(model, tok, prompts, g, seed=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_online(model, tok, prompts, g, seed=3)
    per_forward_casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    cached = sample_online(model, tok, prompts, g, seed=3, precision="bf16")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_online(model, tok, prompts, g, seed=3, precision="bf16")
    cached_casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    assert cached.completion_ids == per_forward.completion_ids
    if decoder:
        torch.testing.assert_close(cached.logprobs, per_forward.logprobs, atol=2e-3, rtol=0)
    else:
        assert cached.logprobs == per_forward.logprobs
    weights = sum(1 for p in model.parameters() if p.dim() == 2) - 1  # the embedding is looked up, not cast
    assert per_forward_casts - cached_casts >= weights * (g.max_new_tokens - 2)
    assert not torch.is_autocast_enabled("cpu")


def _sdpa_input_dtypes(model, ids) -> set:
    """The dtypes the CPU attention kernels receive in one training step (forward + backward) under bf16 autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Record(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids).logits.float().sum().backward()
    return seen


def test_attention_runs_in_fp32_under_cpu_autocast_and_is_plain_sdpa_otherwise(tmp_path):
    """The CPU flash-attention backward is several times slower in bf16: under CPU autocast the attention of a
    converted model gets fp32 inputs (a plain sdpa model's gets bf16), without autocast the logits and gradients
    are bit-identical to plain sdpa, and nothing of it reaches the saved config."""
    import copy
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.precision import CPU_FP32_SDPA, use_fp32_cpu_attention

    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4))
    model = copy.deepcopy(plain)
    use_fp32_cpu_attention(model)
    assert model.config._attn_implementation == CPU_FP32_SDPA and plain.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 64, (3, 10))
    assert _sdpa_input_dtypes(plain, ids) == {torch.bfloat16}
    assert _sdpa_input_dtypes(model, ids) == {torch.float32}
    for m in (plain, model):
        m.zero_grad()
        m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    model.save_pretrained(tmp_path)
    assert CPU_FP32_SDPA not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    assert LlamaForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
