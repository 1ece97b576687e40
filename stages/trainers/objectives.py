"""Pairwise preference objectives by name: the DPO variants, an SFT term, and your own.

An objective is a pure function with one signature:

    fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta,
       chosen_num_tokens, rejected_num_tokens, **extras) -> (losses, chosen_rewards, rejected_rewards)

    chosen_logps, rejected_logps:          (B,) SUMMED completion log-probs under the policy
    ref_chosen_logps, ref_rejected_logps:  (B,) the same under the reference; None with reference_free
    chosen_num_tokens, rejected_num_tokens: (B,) completion token counts (divide by them for
                                           length-normalised objectives such as IPO or SimPO)
    extras:                                label_smoothing, reference_free, bco_delta (accept **extras
                                           and ignore what you do not use)
    returns losses (B,) with gradient, and the implicit rewards (B,) detached, or None when the
    objective has none (they feed the rewards/* metrics only).

`DPOTrainer` takes `loss_type` as one name or a list of names (with `loss_weights`); each name
is a key of `OBJECTIVES` or a dotted import path "package.module:function" to user code, e.g.

    # mylosses.py
    def margin_dpo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, **_):
        ...
    DPOConfig(loss_type="mylosses:margin_dpo", ...)

No registration step: the dotted path is imported when the config is built.
"""
from __future__ import annotations

import importlib
from functools import partial
from typing import Callable

import torch

from stages.losses import DPO_LOSSES, dpo_loss

Objective = Callable[..., tuple]


def _dpo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, loss_type,
         chosen_num_tokens, rejected_num_tokens, label_smoothing=0.0, reference_free=False, bco_delta=None, **_):
    if loss_type == "ipo":  # IPO works on length-averaged log-probs (the IPO paper), for both models
        n_c, n_r = chosen_num_tokens.clamp(min=1), rejected_num_tokens.clamp(min=1)
        chosen_logps, rejected_logps = chosen_logps / n_c, rejected_logps / n_r
        if not reference_free:
            ref_chosen_logps, ref_rejected_logps = ref_chosen_logps / n_c, ref_rejected_logps / n_r
    return dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta,
                    loss_type=loss_type, label_smoothing=label_smoothing, reference_free=reference_free,
                    bco_delta=bco_delta)


def sft_objective(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, chosen_num_tokens, **_):
    """Negative log-likelihood of the chosen completion, mean per token of each pair: (B,); no rewards."""
    return -chosen_logps / chosen_num_tokens.clamp(min=1), None, None


OBJECTIVES: dict[str, Objective] = {**{name: partial(_dpo, loss_type=name) for name in DPO_LOSSES},
                                    "sft": sft_objective}


def resolve_objective(name: str) -> Objective:
    """An `OBJECTIVES` key, or "module:function" imported from user code; ValueError saying what to fix."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(f"{name!r}: neither a built-in objective ({', '.join(OBJECTIVES)}) nor a dotted import "
                         "path 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{name!r}: cannot import {attr!r} from {module!r} ({e}); is the module on PYTHONPATH?"
                         ) from e
    if not callable(fn):
        raise ValueError(f"{name!r} is a {type(fn).__name__}, not a function")
    return fn


def check_objective_output(name: str, out, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                        torch.Tensor | None]:
    """Validate what an objective returned: (losses (B,), rewards (B,) or None, rewards (B,) or None)."""
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"objective {name!r} must return (losses, chosen_rewards, rejected_rewards), "
                         f"got {type(out).__name__}")
    losses = out[0]
    if not (isinstance(losses, torch.Tensor) and losses.shape == (batch_size,)):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"objective {name!r} returned losses of shape {shape}: expected ({batch_size},), one loss "
                         "per pair (do not reduce; the trainer weights and averages)")
    return out


def objective_problems(loss_type: str | list[str]) -> list[tuple[str, str]]:
    """Each objective named in `loss_type` is known or imports (user code, by dotted path)."""
    problems = []
    for i, name in enumerate([loss_type] if isinstance(loss_type, str) else loss_type):
        key = "loss_type" if isinstance(loss_type, str) else f"loss_type[{i}]"
        if name in OBJECTIVES:
            continue
        if ":" not in name:
            problems.append((key, f"= {name!r}: supported: {', '.join(OBJECTIVES)}, or a dotted import path "
                             "'package.module:function'"))
            continue
        try:
            resolve_objective(name)
        except ValueError as e:
            problems.append((key, f"= {e}"))
    return problems
