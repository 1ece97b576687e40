"""A Mixture-of-Experts router's load-balancing loss weight (TRL's `router_aux_loss_coef`) for the online trainers.
Dropout (`stages.trainers.inputs.disable_dropout`) and TR-DPO's reference sync (`stages.trainers.ref_sync`) are the
offline trainers' too."""
from __future__ import annotations


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
