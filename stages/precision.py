"""Mixed precision: which autocast a training stage runs under, and running a model's forward the same way.

A `transformers.Trainer` with `bf16=True` (or `fp16=True`) has accelerate wrap the trained model's
forward in `torch.autocast` and cast its floating outputs back to fp32; the weights stay at the
model's dtype (fp32: fp32 master weights), and what runs after the forward (the chunked lm-head
log-probs of `stages.logprobs`) runs in fp32 on those outputs. A reference computed for
that policy outside its Trainer (the `reference` stage, a frozen copy, a precompute before
`train()`) must run the same way: otherwise the policy at step 0 differs from its reference by
the autocast's rounding, and DPO's first margins are that rounding instead of 0.
`autocast_forward` is that wrapping, with accelerate's own output conversion.

Attention under CPU autocast runs in fp32 (`CPU_FP32_SDPA`, given by `use_fp32_cpu_attention`): torch's
CPU flash-attention backward is much slower in bf16 than in fp32 at small head sizes (docs/decisions.md).
The matmuls stay in bf16. Without CPU autocast (fp32, any GPU) the attention is plain `sdpa`, bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from stages.sharding import unwrap_wrappers

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


CPU_FP32_SDPA = "sdpa_cpu_fp32"  # transformers' sdpa, computed in fp32 under CPU autocast (registered below)


def _sdpa_fp32_under_cpu_autocast(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_cpu_fp32_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_FP32_SDPA, _sdpa_fp32_under_cpu_autocast)
    AttentionMaskInterface.register(CPU_FP32_SDPA, sdpa_mask)  # the same masks as sdpa


def use_fp32_cpu_attention(model) -> None:
    """Switch an `sdpa` model (through DDP/accelerate wrappers) to CPU_FP32_SDPA, in memory only (the saved
    config.json does not record an attention implementation); other implementations are left alone."""
    model = unwrap_wrappers(model)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        _register_cpu_fp32_sdpa()
        model.set_attn_implementation(CPU_FP32_SDPA)


def mixed_precision(setting: str, device: str, section: str) -> str:
    """The autocast a stage trains under ("no", "bf16" or "fp16") for `{section}.mixed_precision` on `device`.

    auto: bf16 on a GPU that has it, else no: on CPU the quickstart at bf16 is no faster as a whole and its
    DPO policy is less accurate (docs/decisions.md). bf16 runs on CPU too (torch's CPU autocast); fp16 needs
    a GPU (its loss scaler is CUDA's)."""
    if setting == "auto":
        return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "no"
    if setting == "fp16" and device != "cuda":
        raise ValueError(f"{section}.mixed_precision = 'fp16' needs a GPU; this run is on {device}: use bf16 "
                         "(CPU autocast), no or auto")
    if setting == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{section}.mixed_precision = 'bf16': this GPU has no bfloat16; use fp16, no or auto")
    return setting


def trainer_precision(args) -> str:
    """The autocast of a Trainer's arguments: "bf16", "fp16" or "no"."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"


def wrap_forward(model, precision: str):
    """`model` with its forward under `torch.autocast(precision)` and fp32 outputs, as accelerate wraps the
    model a Trainer trains (in place; "no": unchanged). The device type is the parameters' at each call."""
    if precision == "no":
        return model
    from accelerate.utils import convert_outputs_to_fp32

    use_fp32_cpu_attention(model)
    dtype, forward = AUTOCAST_DTYPES[precision], model.forward

    @functools.wraps(forward)  # keeps the signature: `lm_head_for_chunking` reads it, as through accelerate's
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=next(model.parameters()).device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)
    return model


@contextlib.contextmanager
def autocast_forward(model, precision: str) -> Iterator:
    """Inside, `model`'s forward runs as `wrap_forward` makes it; restored on exit."""
    own = "forward" in vars(model)  # an instance-level forward already (e.g. accelerate's): put it back
    previous = vars(model).get("forward")
    wrap_forward(model, precision)
    try:
        yield model
    finally:
        if precision != "no":
            if own:
                model.forward = previous
            else:
                del model.forward


@contextlib.contextmanager
def cached_casts(model, precision: str) -> Iterator[None]:
    """One autocast region around many forwards of unchanged weights (a generate call's decode steps).

    Each forward that `wrap_forward` (or accelerate) wraps enters and leaves its own autocast, and
    leaving the outermost one drops torch's cache of the weights' low-precision casts: every decode
    step would cast every weight again. Inside this region the forwards' own autocasts are nested,
    so each weight is cast once per region; the casts, and so the numbers, are the same. Only for
    regions in which no weight is updated. "no": nothing."""
    if precision == "no":
        yield
        return
    with torch.autocast(device_type=next(model.parameters()).device.type, dtype=AUTOCAST_DTYPES[precision]):
        yield

