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

`causal_lm(model)` reads what the forward's blocks need of a model once: the module to call (wrappers
kept), the model inside the DDP / accelerate / FSDP1 wrappers, its final norm, the head to chunk with,
its attention, sharding, sliding window and dtype. A trainer builds it at its edge and passes it down
(`stages.trainers.pair_batches.token_logps` and the packing in `stages.pair_packing` take it), so no
block below unwraps again.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.kernels import chunked_logprobs
from stages.sharding import chunking_allowed, gathered_head, module_type, sharding_engine, unwrap, unwrap_wrappers

LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class CausalLM:
    """What the forward's blocks need of a causal LM, read once by `causal_lm` where a trainer's forward starts
    and passed down, so no block below unwraps the model again."""

    model: nn.Module              # what to call: DDP / accelerate / FSDP wrappers kept, so their hooks fire
    inner: nn.Module              # inside those wrappers (PEFT kept): packing's check runs it
    norm: nn.Module | None        # the final norm, whose output is the last hidden state (`final_norm`)
    head: nn.Linear | None        # the output layer for chunked_logprobs; None: the logits path
    attention: str | None         # config._attn_implementation
    sharded: str | None           # `stages.sharding.sharding_engine`: FSDP2, FSDP1, ZeRO-3 or None
    sliding_window: int | None
    dtype: torch.dtype            # of the parameters
    no_logits: int | torch.Tensor  # the `logits_to_keep` of a forward whose hidden states are read (`no_logits`)

    def hidden(self, inputs: dict, **kwargs) -> tuple[torch.Tensor, Any]:
        """`final_hidden` of `model`, through the final norm found once."""
        return hidden_through(self.model, self.norm, inputs, **kwargs)


def causal_lm(model) -> CausalLM:
    """`model` unwrapped once, and what the blocks need of it (a `CausalLM` is returned as it is). The head
    depends on whether gradients are on (`stages.sharding.chunking_allowed`): build it where the forward runs."""
    if isinstance(model, CausalLM):
        return model
    inner = unwrap_wrappers(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    engine = sharding_engine(model)
    config = getattr(inner, "config", None)
    keep, norm = _no_logits(type(base)), _final_norm(base)
    return CausalLM(model=model, inner=inner, norm=norm, head=_chunking_head(base, engine),
                    attention=getattr(config, "_attn_implementation", None), sharded=engine,
                    sliding_window=getattr(config, "sliding_window", None), dtype=next(inner.parameters()).dtype,
                    no_logits=keep)


def lm_head_for_chunking(model) -> nn.Linear | None:
    """The output layer to use with chunked_logprobs, or None when the logits path is required."""
    return _chunking_head(unwrap(model), sharding_engine(model))


def _chunking_head(base, engine: str | None) -> nn.Linear | None:
    """`lm_head_for_chunking` of `base` (unwrapped from every wrapper, PEFT's too) sharded by `engine`."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if module_type(head) is not nn.Linear:
        return None
    config = getattr(base, "config", None)
    for attr in LOGIT_POSTPROCESSING:
        value = getattr(config, attr, None)
        # a scale of 1 changes nothing; a soft-cap is applied whenever set (tanh(x / 1) * 1 is no identity)
        if value not in ((None,) if attr.endswith("softcapping") else (None, 1, 1.0)):
            return None
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    if not chunking_allowed(engine):
        return None
    return head


def no_logits(model) -> int | torch.Tensor:
    """The `logits_to_keep` of a forward whose final hidden states are read and whose logits are not: no position
    (an empty index) where the model's forward takes an index there (transformers' `int | torch.Tensor`), else the
    last position only. Computing even one position's logits costs a (rows, vocab) matmul per forward."""
    return _no_logits(type(unwrap(model)))


_NO_LOGITS: dict[type[nn.Module], int | torch.Tensor] = {}  # per model class: its forward's signature does not change


def _no_logits(model_type: type[nn.Module]) -> int | torch.Tensor:
    if model_type not in _NO_LOGITS:
        param = inspect.signature(model_type.forward).parameters.get("logits_to_keep")
        takes_index = param is not None and "Tensor" in str(param.annotation)
        _NO_LOGITS[model_type] = torch.empty(0, dtype=torch.long) if takes_index else 1
    return _NO_LOGITS[model_type]


def selected_hidden(model, inputs: dict, select: torch.Tensor):
    """Forward pass; final hidden states at next-token-prediction positions where `select`: (N, H).

    select: (B, T-1) bool, True where position t's prediction of token t+1 is needed.
    """
    hidden, out = final_hidden(model, {**inputs, "use_cache": False}, logits_to_keep=no_logits(model))
    return hidden[:, :-1][select], out


def final_norm(model) -> nn.Module | None:
    """The module whose output is the model's last hidden state (`hidden_states[-1]`): the base model's final
    norm (`norm`: Llama, Mistral, Qwen2, Gemma; `ln_f`: GPT-2), or None when there is no such module."""
    return _final_norm(unwrap(model))


def _final_norm(base: nn.Module) -> nn.Module | None:
    trunk = getattr(base, "base_model", None)
    for name in ("norm", "ln_f"):
        module = getattr(trunk, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def final_hidden(model, inputs: dict, **kwargs) -> tuple[torch.Tensor, Any]:
    """`model(**inputs, **kwargs)` and its final hidden states (B, T, H): (hidden, outputs).

    The hidden states are taken from the final norm's output by a forward hook: output_hidden_states=True
    would also keep every layer's output, (layers + 1) x (B, T, H), alive as long as the outputs (in no-grad
    reference and rollout passes nothing else holds them). Models without a recognised final norm fall
    back to output_hidden_states. The forward is still `model`'s own, so DDP / FSDP hooks fire as usual.
    """
    return hidden_through(model, final_norm(model), inputs, **kwargs)


def hidden_through(module: nn.Module, norm: nn.Module | None, inputs: dict, **kwargs) -> tuple[torch.Tensor, Any]:
    """`module(**inputs, **kwargs)` and the output of `norm` inside it (see `final_hidden`)."""
    if norm is None:
        out = module(**inputs, output_hidden_states=True, **kwargs)
        return out.hidden_states[-1], out
    caught = []
    handle = norm.register_forward_hook(lambda _module, args, output: caught.append(output))
    try:
        out = module(**inputs, **kwargs)
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
