"""Model-level options of the online trainers, TRL's names: dropout off, a MoE router's load-balancing loss
weight, TR-DPO's reference sync (a callback). Small functions a trainer calls once."""
from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from stages.sharding import unwrap


def router_aux_loss_coef(model, coef: float | None) -> float:
    """The weight of a Mixture-of-Experts model's load-balancing loss: `coef`, else its config's (0: none, and for
    a model without a router). A coefficient set for a model without a router is an error."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    moe = hasattr(config, "output_router_logits")
    if coef and not moe:
        raise ValueError(f"router_aux_loss_coef = {coef}, but {type(model).__name__} is not a Mixture-of-Experts model "
                         "(its config has no output_router_logits); remove router_aux_loss_coef")
    if not moe:
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else coef


def disable_dropout(model) -> None:
    """Dropout off in `model` (None: nothing): every nn.Dropout, and the attention dropout rate the attention
    modules read from their `attention_dropout` attribute (HF's Llama, Qwen, Mistral) and the config."""
    if model is None:
        return
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for holder in (module, getattr(module, "config", None)):  # attention modules and the model config
            if isinstance(getattr(holder, "attention_dropout", None), float):
                setattr(holder, "attention_dropout", 0.0)  # noqa: B010


class SyncReference(TrainerCallback):
    """TR-DPO for GRPO: after every ref_model_sync_steps optimizer steps, ref <- alpha x policy + (1 - alpha) x ref."""

    def __init__(self, trainer):
        self.trainer = trainer

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps:
            return
        alpha = args.ref_model_mixup_alpha
        policy = dict(unwrap(self.trainer.model).named_parameters())
        for name, ref in unwrap(self.trainer.ref_model).named_parameters():
            ref.mul_(1 - alpha).add_(policy[name].detach().to(ref.device, ref.dtype), alpha=alpha)
