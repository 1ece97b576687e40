"""The SFT loss through the chunked lm-head kernel equals the full-logits loss, gradients included."""
import pytest
import torch
from torch import nn

from stages.logprobs import head_argmax, head_logprobs, head_operands, lm_head_for_chunking, selected_hidden
from stages.losses import IGNORE_INDEX, sft_loss, sft_loss_from_logps
from tests.stages.trainers.conftest import build_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path)


def test_chunked_loss_and_grads_match_logits_path(model):
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (3, 9))
    attention = torch.ones_like(ids)
    attention[2, 6:] = 0
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[attention == 0] = IGNORE_INDEX
    inputs = {"input_ids": ids, "attention_mask": attention}

    model.zero_grad()
    ref, stats = sft_loss(model(**inputs).logits, labels)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    head = lm_head_for_chunking(model)
    assert head is model.lm_head
    select = labels[:, 1:] != IGNORE_INDEX
    hidden, _ = selected_hidden(model, inputs, select)
    loss = sft_loss_from_logps(head_logprobs(hidden, head, labels[:, 1:][select]))
    loss.backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5), n
    correct = (head_argmax(hidden.detach(), head) == labels[:, 1:][select]).sum()
    assert correct == stats["correct_tokens"]


def test_falls_back_when_logits_are_post_processed(model):
    model.config.final_logit_softcapping = 30.0
    try:
        assert lm_head_for_chunking(model) is None
    finally:
        model.config.final_logit_softcapping = None
    assert lm_head_for_chunking(model) is not None


def test_falls_back_for_non_linear_head(model):
    class Quantized(nn.Linear):  # e.g. bitsandbytes' Linear4bit subclasses nn.Linear
        pass

    original = model.lm_head
    model.lm_head = Quantized(original.in_features, original.out_features, bias=False)
    try:
        assert lm_head_for_chunking(model) is None
    finally:
        model.lm_head = original


def test_head_runs_in_its_compute_dtype_when_mixed_precision_hands_back_float32_hidden_states():
    """A bf16 head with float32 hidden states (accelerate converts the forward's outputs to float32 under
    mixed precision) gives what `head(hidden.bf16())` gives, as the model's own forward would; under autocast
    the autocast dtype wins over the weight's."""
    torch.manual_seed(0)
    head = nn.Linear(8, 11).to(torch.bfloat16)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 11, (5,))
    want = torch.log_softmax(head(hidden.bfloat16()).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(head_logprobs(hidden, head, targets).float(), want, atol=2e-2)
    assert torch.equal(head_argmax(hidden, head), head(hidden.bfloat16()).argmax(-1))
    fp32 = nn.Linear(8, 11)
    assert {t.dtype for t in head_operands(hidden, fp32.weight, fp32.bias)} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {t.dtype for t in head_operands(hidden, fp32.weight, fp32.bias)} == {torch.bfloat16}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gemma2", "mistral"])
def test_final_hidden_is_the_last_of_output_hidden_states(arch, tmp_path):
    """The final norm's output, caught by a hook, is bit-identical to `hidden_states[-1]` of the same forward
    in training mode and under bf16 autocast, for every tested architecture; without output_hidden_states no
    layer's output is kept, gradients flow through the caught tensor, and `no_logits` computes no logits at all."""
    from transformers import AutoModelForCausalLM

    from stages.logprobs import final_hidden, final_norm, no_logits
    from stages.precision import autocast_forward
    from tests import architectures

    path = build_tiny(tmp_path / "m") if arch == "llama" else getattr(architectures, arch)(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path).train()
    assert final_norm(model) is not None
    ids = torch.tensor([[3, 5, 9, 13, 2, 7], [4, 6, 8, 10, 12, 1]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    for precision in ("no", "bf16"):
        with autocast_forward(model, precision):  # one forward: GPT-2's dropout makes two forwards differ
            hidden, out = final_hidden(model, inputs, logits_to_keep=1, output_hidden_states=True)
            lean, lean_out = final_hidden(model, inputs, logits_to_keep=no_logits(model))
        assert torch.equal(hidden.float(), out.hidden_states[-1].float()), precision
        assert lean.requires_grad and lean.shape == hidden.shape and lean_out.hidden_states is None
        assert lean_out.logits.shape[:2] == (2, 0), precision


def test_no_logits_keeps_the_last_position_where_the_forward_takes_no_index():
    """A forward whose `logits_to_keep` is an int only (older or remote code) gets 1, not an empty index."""
    from stages.logprobs import no_logits

    class IntOnly(nn.Module):
        def forward(self, input_ids=None, logits_to_keep: int = 0):
            return input_ids

    class Indexed(nn.Module):
        def forward(self, input_ids=None, logits_to_keep: int | torch.Tensor = 0):
            return input_ids

    assert no_logits(IntOnly()) == 1
    keep = no_logits(Indexed())
    assert isinstance(keep, torch.Tensor) and keep.numel() == 0 and keep.dtype == torch.long


def test_causal_lm_reads_a_wrapped_peft_model_once_as_the_functions_read_it(model):
    """The view of a PEFT model inside a DDP-like wrapper (`.module`) holds what the per-call functions find, and
    the forward through the view is the wrapper's own (its hooks fire)."""
    from peft import LoraConfig, get_peft_model

    from stages.logprobs import causal_lm, final_hidden, final_norm

    class Wrapper(nn.Module):  # what DDP and accelerate look like to unwrap_wrappers: the model under `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, **kw):
            self.calls += 1
            return self.module(**kw)

    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    try:
        wrapped = Wrapper(peft)
        lm = causal_lm(wrapped)
        assert causal_lm(lm) is lm and lm.model is wrapped and lm.inner is peft
        assert lm.head is lm_head_for_chunking(wrapped) is model.lm_head
        assert lm.norm is final_norm(wrapped) is model.model.norm
        assert (lm.attention, lm.sharded, lm.dtype) == (model.config._attn_implementation, None, torch.float32)
        ids = torch.randint(0, 300, (2, 7))
        hidden, _ = lm.hidden({"input_ids": ids})
        assert wrapped.calls == 1 and hidden.shape == (2, 7, model.config.hidden_size)
        assert torch.equal(hidden, final_hidden(wrapped, {"input_ids": ids})[0])
        with torch.no_grad():  # without gradients the head stays (unsharded: always); the view is read per forward
            assert causal_lm(wrapped).head is model.lm_head
    finally:
        peft.unload()
