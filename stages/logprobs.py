"""Log-probabilities of target tokens under a causal LM, without full logits where the model allows.

`lm_head_for_chunking(model)` decides whether the model's output layer can be fed to
`stages.kernels.chunked_logprobs` (hidden states x head weight, chunk by chunk, never the
(tokens, vocab) logits). It falls back (returns None) when the logits are not a plain
`hidden @ W.T (+ b)`:

- the output layer is not a plain `torch.nn.Linear` (quantized 4/8-bit heads, a LoRA
  adapter on the head, tied heads wrapped in custom modules);
- the config post-processes logits (`final_logit_softcapping`, `logit_scale`,
  `logits_scaling`, ... as in Gemma 2, Cohere, Granite);
- the forward has no `logits_to_keep` argument (the logits could not be skipped anyway);
- the parameters are sharded (FSDP, DeepSpeed ZeRO-3) and gradients are on: the engine reduces
  only gradients taken inside a module's forward (`stages.sharding`). Without gradients
  the sharded head is gathered for the call (`head_logprobs`, `head_argmax`).

The trainers then run the model's forward themselves (so DDP/FSDP hooks fire as usual),
asking for the final hidden states and only one position of logits.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from stages.kernels import chunked_logprobs
from stages.sharding import chunking_allowed, gathered_head, module_type, unwrap

LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def lm_head_for_chunking(model) -> nn.Linear | None:
    """The output layer to use with chunked_logprobs, or None when the logits path is required."""
    inner = unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if module_type(head) is not nn.Linear:
        return None
    config = getattr(inner, "config", None)
    for attr in LOGIT_POSTPROCESSING:
        value = getattr(config, attr, None)
        # a scale of 1 changes nothing; a soft-cap is applied whenever set (tanh(x / 1) * 1 is no identity)
        if value not in ((None,) if attr.endswith("softcapping") else (None, 1, 1.0)):
            return None
    if "logits_to_keep" not in inspect.signature(inner.forward).parameters:
        return None
    if not chunking_allowed(model):
        return None
    return head


def selected_hidden(model, inputs: dict, select: torch.Tensor):
    """Forward pass; final hidden states at next-token-prediction positions where `select`: (N, H).

    select: (B, T-1) bool, True where position t's prediction of token t+1 is needed.
    """
    hidden, out = final_hidden(model, {**inputs, "use_cache": False}, logits_to_keep=1)
    return hidden[:, :-1][select], out


def final_norm(model) -> nn.Module | None:
    """The module whose output is the model's last hidden state (`hidden_states[-1]`): the base model's final
    norm (`norm`: Llama, Mistral, Qwen2, Gemma; `ln_f`: GPT-2), or None when there is no such module."""
    base = getattr(unwrap(model), "base_model", None)
    for name in ("norm", "ln_f"):
        module = getattr(base, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def final_hidden(model, inputs: dict, **kwargs) -> tuple[torch.Tensor, object]:
    """`model(**inputs, **kwargs)` and its final hidden states (B, T, H): (hidden, outputs).

    The hidden states are taken from the final norm's output by a forward hook: output_hidden_states=True
    would also keep every layer's output, (layers + 1) x (B, T, H), alive as long as the outputs (in no-grad
    reference and rollout passes nothing else holds them). Models without a recognised final norm fall
    back to output_hidden_states. The forward is still `model`'s own, so DDP / FSDP hooks fire as usual.
    """
    norm = final_norm(model)
    if norm is None:
        out = model(**inputs, output_hidden_states=True, **kwargs)
        return out.hidden_states[-1], out
    caught = []
    handle = norm.register_forward_hook(lambda module, args, output: caught.append(output))
    try:
        out = model(**inputs, **kwargs)
    finally:
        handle.remove()
    return caught[-1], out


def head_logprobs(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, **kw):
    """log p(targets) from hidden states: (N, H), targets: (N,) -> (N,) (and entropy with return_entropy)."""
    with gathered_head(head) as (weight, bias):
        hidden, weight, bias = head_operands(hidden, weight, bias)
        return chunked_logprobs(hidden, weight, targets, bias=bias, **kw)


def head_operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(hidden, weight, bias) in the dtype the head's matmul runs in inside the model's forward: the autocast
    dtype under autocast, else the weight's. Mixed precision hands back float32 hidden states (accelerate
    converts a forward's outputs to float32) while a bf16 model's head runs in bf16."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@torch.no_grad()
def head_argmax(hidden: torch.Tensor, head: nn.Linear, rows: int = 1024) -> torch.Tensor:
    """Greedy token per row, in row chunks (for accuracy metrics): (N, H) -> (N,)."""
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    with gathered_head(head) as (weight, bias):
        hidden, weight, bias = head_operands(hidden, weight, bias)
        for start in range(0, hidden.shape[0], rows):
            out[start:start + rows] = nn.functional.linear(hidden[start:start + rows], weight, bias).argmax(-1)
    return out
