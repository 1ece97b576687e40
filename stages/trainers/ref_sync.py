"""TR-DPO's reference syncing (TRL's `sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`; Gorbatovski
et al. 2024, arXiv:2404.09656): every `ref_model_sync_steps` optimizer steps the frozen reference moves towards
the policy, ref <- α·policy + (1 - α)·ref, so the KL anchor follows training instead of staying at the start.

`SyncReference` is the `transformers.TrainerCallback` that does it for DPO and KTO (`mix_into` is the update); the
configs refuse it where there is no separate reference to move (PEFT's adapter-disabled base) or no reference
model at all (precomputed reference log-probs).
"""
from __future__ import annotations

import torch
from transformers import TrainerCallback


@torch.no_grad()
def mix_into(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """reference <- alpha · policy + (1 - alpha) · reference, parameter by parameter (matched by name)."""
    source = dict(policy.named_parameters())
    for name, param in reference.named_parameters():
        if name not in source:
            raise ValueError(f"sync_ref_model: the reference has parameter {name!r} that the policy lacks; "
                             "the reference must be a copy of the policy's architecture")
        param.mul_(1.0 - alpha).add_(source[name].detach().to(param.dtype), alpha=alpha)


def sync_reference(trainer) -> None:
    """Add `SyncReference` to `trainer` when its args ask for it; ValueError when it has no reference model of its
    own to move (PEFT's adapter-disabled base, reference_free, precomputed columns)."""
    if not trainer.args.sync_ref_model:
        return
    if trainer.ref_model is None:
        raise ValueError(f"{type(trainer.args).__name__}.sync_ref_model = true, but this trainer keeps no reference "
                         "model to move: with PEFT the reference is the adapter-disabled base, and reference_free or "
                         "precomputed reference log-probs need none; pass ref_model= (a copy of the base), or set "
                         "sync_ref_model: false")
    trainer.add_callback(SyncReference(trainer))


class SyncReference(TrainerCallback):
    """Mixes the trainer's `ref_model` towards its policy every `args.ref_model_sync_steps` optimizer steps."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            from stages.sharding import unwrap

            mix_into(self.trainer.ref_model, unwrap(self.trainer.model), args.ref_model_mixup_alpha)
