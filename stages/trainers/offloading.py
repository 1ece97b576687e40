"""Activation offloading (TRL's `activation_offloading`): the tensors autograd keeps for the backward pass
are copied to CPU memory during the forward and brought back for the backward (`torch.autograd.graph.
save_on_cpu`, pinned memory when CUDA is present), trading transfer time for GPU memory.

`OffloadsActivations` is a `transformers.Trainer` mixin: it adds that context to `compute_loss_context_manager`,
which the Trainer enters around each forward of `training_step` (the backward runs outside it, and the saved
tensors come back through their unpack hooks).
"""
from __future__ import annotations

import torch


class OffloadsActivations:
    """Mixin before `transformers.Trainer` in a trainer's bases; reads `self.args.activation_offloading`."""

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()  # type: ignore[misc]
        if getattr(self.args, "activation_offloading", False):  # type: ignore[attr-defined]
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
        return stack
