"""What our own code must do differently when the model's parameters are sharded (FSDP, DeepSpeed ZeRO-3).

Under FSDP2 (`fully_shard`, what configs/accelerate/fsdp.yaml selects) and DeepSpeed ZeRO-3 each rank holds a
slice of every parameter; the engine gathers a module's parameters around that module's own forward and
reduces its gradients after its backward. Our code reads the output layer's weight outside the forward, copies
the model for the frozen reference and generates token by token, so:

- chunked log-probs with gradients take the logits path (`lm_head_for_chunking` returns None: the engine would
  not reduce a gradient reaching the head outside its forward); without gradients the head's weight is
  gathered for the call (`gathered_head`);
- the frozen reference is loaded from the model's checkpoint folder and sharded the same way
  (`frozen_reference`, `sharded_reference`), never deep-copied from shards;
- generation runs every rank's forwards in lockstep (`synced_gpus`), since each forward is a collective.

FSDP1 (`FullyShardedDataParallel` wrappers) flattens parameters; it always takes the logits path.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

FSDP2, FSDP1, ZERO3 = "fsdp2", "fsdp1", "deepspeed-zero3"


def _fsdp_classes():
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed support
        return None, None
    return FSDPModule, FullyShardedDataParallel


def sharding_engine(model) -> str | None:
    """FSDP2, FSDP1 or ZERO3 when `model` (possibly wrapped by DDP / accelerate / PEFT) has sharded
    parameters, else None."""
    fsdp2, fsdp1 = _fsdp_classes()
    node = model
    while True:
        if fsdp1 is not None and isinstance(node, fsdp1):
            return FSDP1
        if not hasattr(node, "module"):
            break
        node = node.module
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in node.modules()):
        return FSDP2
    if any(hasattr(p, "ds_id") for p in node.parameters()):  # DeepSpeed ZeRO-3 partitions every parameter
        return ZERO3
    return None


def module_type(module: object) -> type:
    """The class of `module` before `fully_shard` swapped it for a subclass `FSDP<Name>(FSDPModule, <Name>)`."""
    fsdp2, _ = _fsdp_classes()
    cls = type(module)
    if fsdp2 is not None and isinstance(module, fsdp2):
        return next(base for base in cls.__bases__ if base is not fsdp2)
    return cls


def chunking_allowed(engine: str | None) -> bool:
    """Whether the head's weight may be read outside the forward of a model sharded by `engine`
    (`sharding_engine`): never under FSDP1, and under FSDP2 / ZeRO-3 only when no gradient is taken
    (see the module docstring)."""
    return engine is None or (engine != FSDP1 and not torch.is_grad_enabled())


@contextlib.contextmanager
def gathered_head(head: nn.Linear) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """`(weight, bias)` of the output layer, whole on every rank for the duration (a collective: every
    rank must enter it). Unsharded parameters are yielded as they are.

    FSDP2 keeps the root module's parameters unsharded after its forward, but a head wrapped by its
    own `fully_shard` is resharded (a DTensor shard) by then: it is all-gathered here.
    """
    params = [head.weight, head.bias]
    if any(hasattr(p, "ds_id") for p in params if p is not None):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in params if p is not None], modifier_rank=None):
            yield head.weight, head.bias
        return
    from torch.distributed.tensor import DTensor

    weight, bias = (p.full_tensor() if isinstance(p, DTensor) else p for p in params)
    yield weight, bias


def generate_kwargs(model) -> dict:
    """Extra `model.generate` arguments for a sharded model on several ranks: every rank runs a forward
    until all ranks are done (transformers detects only some wrappings on its own)."""
    import torch.distributed as dist

    if sharding_engine(model) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return {"synced_gpus": True}
    return {}


def unwrap_wrappers(model):
    """`model` without DDP / accelerate wrappers (PEFT kept, unlike `unwrap`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def unwrap(model):
    """The model inside the DDP / accelerate wrappers and PEFT's adapter wrapper."""
    model = unwrap_wrappers(model)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model


def sharded_reference(model):
    """A frozen reference for a sharded `model`: its checkpoint loaded again (`config._name_or_path`) and
    sharded over the same modules, never a copy of the shards. ValueError when there is no folder to load
    from or the engine is not FSDP2."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    engine, inner = sharding_engine(model), unwrap(model)
    source = getattr(inner.config, "_name_or_path", "") or ""
    fix = ("precompute the reference log-probs (the pipeline's `reference` stage, or the trainer's "
           "precompute_ref_log_probs), train LoRA (the reference is the base with the adapter off), or run "
           "the reference-free variant")
    if engine != FSDP2:
        raise ValueError(f"a frozen reference copy of a {engine}-sharded model is not supported: {fix}")
    if not (Path(source) / "config.json").is_file():
        raise ValueError(f"the model is sharded (FSDP2) and its checkpoint folder is unknown ({source!r}), so the "
                         f"frozen reference cannot be loaded from it (a copy of the shards would be wrong): {fix}")
    fsdp2, _ = _fsdp_classes()
    dtype = next(inner.parameters()).dtype
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    from torch.distributed.fsdp import fully_shard

    sharded = [name for name, m in inner.named_modules() if isinstance(m, fsdp2)]
    modules = dict(ref.named_modules())
    for name in reversed(sharded):  # innermost first, as fully_shard requires
        fully_shard(modules[name])
    return ref
