"""A Mixture-of-Experts router's load-balancing loss (TRL's `router_aux_loss_coef`) for every trainer that has it.

`router_aux_loss_coef` resolves the weight (the setting, else the model config's; refused on a model without a
router). The online trainers ask `rollout.completion_logps(with_aux_loss=True)` for the loss of their forward; the
offline ones (SFT, DPO, KTO) run the policy's forward inside `router_losses`, which asks the model for its router
logits and collects the load-balancing loss it returns, without threading a flag through the log-prob helpers.
Dropout (`stages.trainers.inputs.disable_dropout`) and TR-DPO's reference sync (`stages.trainers.ref_sync`) are
the offline trainers' too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


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


@contextlib.contextmanager
def router_losses(model, enabled: bool) -> Iterator[list]:
    """While open (and `enabled`), every call of `model` (the module the trainer calls: DDP, PEFT or the causal
    LM itself, which pass keyword arguments through) gets output_router_logits=True, and the load-balancing loss
    each call returns is appended to the yielded list (a scalar tensor with its graph). Disabled: an empty list,
    and the model untouched."""
    losses: list = []
    if not enabled:
        yield losses
        return

    def ask(module, args, kwargs):
        return args, {**kwargs, "output_router_logits": True}

    def collect(module, args, kwargs, output):
        aux = getattr(output, "aux_loss", None)
        if aux is None:
            raise ValueError(f"router_aux_loss_coef > 0, but {type(module).__name__} returned no aux_loss with "
                             "output_router_logits=True (not a Mixture-of-Experts model?)")
        losses.append(aux)

    handles = [model.register_forward_pre_hook(ask, with_kwargs=True),
               model.register_forward_hook(collect, with_kwargs=True)]
    try:
        yield losses
    finally:
        for handle in handles:
            handle.remove()


def with_router_loss(loss, losses: list, coef: float, metrics: dict | None = None, *, steps: int = 1):
    """`loss` + coef x the mean of the collected load-balancing `losses` / `steps` (the accumulation steps when the
    loss is already scaled for them); their mean is recorded as metrics["aux_loss"]. No losses: `loss` as is."""
    if not losses:
        return loss
    aux = sum(losses) / len(losses)
    if metrics is not None:
        metrics["aux_loss"] = aux.detach()
    return loss + coef * aux / steps
