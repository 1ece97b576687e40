"""The reference model, one way for every method (DPO, KTO, online DPO, GRPO, PPO).

What a method compares its policy with, in order of preference:

- precomputed columns: the reference's log-probs stored in the rows (`REF_COLUMNS`, from
  `reference_logps_table` / `compute_reference_logps`, or the pipeline's `reference` stage):
  no reference model at all;
- adapter disabled: with a PEFT (LoRA) policy, the same weights with the adapter switched off,
  no second copy in memory;
- a frozen copy of the starting model (`frozen_reference`), or the `ref_model` given; a sharded
  model (FSDP2) is not copied but loaded again from its checkpoint folder and sharded the same way
  (`stages.sharding.sharded_reference`);
- none (`needed=False`: reference_free DPO, GRPO with beta 0).

`reference_model(model, ref, precision=...)` yields the module to run, its forward under the
policy's autocast (so that the policy at step 0 equals its reference). It unwraps `model` from
DDP / accelerate wrappers first: `DistributedDataParallel` forwards no attribute of the model
inside it, so `disable_adapter` must be called on the unwrapped PEFT model.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from stages.logprobs import CausalLM
from stages.precision import autocast_forward
from stages.sharding import sharded_reference, sharding_engine, unwrap, unwrap_wrappers  # noqa: F401 (re-exported)
from stages.trainers.pair_batches import (
    REF_COLUMNS,
    PairCollator,
    completion_token_counts,
    sequence_logps,
    tokenize_pairs,
)

REFERENCE_FORWARDS = 0  # reference forward passes run so far (see reference_sequence_logps); for tests/benchmarks


def is_peft(model) -> bool:
    return hasattr(unwrap_wrappers(model), "disable_adapter")


def frozen_reference(model, ref_model=None, *, needed: bool = True):
    """The reference model to keep: `ref_model`, else a frozen copy of `model` when `needed` and
    `model` is not a PEFT model (whose reference is itself with the adapter disabled), else None."""
    if not needed:
        return None
    if ref_model is None and not is_peft(model):
        ref_model = sharded_reference(model) if sharding_engine(model) else copy.deepcopy(unwrap(model))
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
    return ref_model


@contextlib.contextmanager
def reference_model(model, ref_model, *, precision: str = "no"):
    """The module to run as the reference: `ref_model` on `model`'s device, or `model` (unwrapped from
    DDP) with its adapter off; its forward under the policy's autocast `precision` ("no", "bf16", "fp16";
    `stages.precision.trainer_precision(args)`), as the Trainer runs the policy's, so that the
    policy at step 0 equals its reference. Run it under no_grad. `model`: a module or its
    `stages.logprobs.CausalLM`."""
    inner: Any = model.inner if isinstance(model, CausalLM) else unwrap_wrappers(model)
    if ref_model is not None:
        with autocast_forward(ref_model.to(next(inner.parameters()).device), precision) as ref:
            yield ref
    elif is_peft(inner):
        with inner.disable_adapter(), autocast_forward(inner, precision):
            yield inner
    else:
        raise ValueError("no reference model: pass ref_model, use a PEFT model, or turn the reference off "
                         "(reference_free, beta = 0)")


def precomputed(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's precomputed reference log-probs (chosen, rejected), each (B,), or None."""
    if all(c in batch for c in REF_COLUMNS):
        return batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]]
    return None


@torch.no_grad()
def reference_sequence_logps(ref, batch: dict[str, torch.Tensor], *, chunked: bool = True, pairs: bool = False,
                             ld_alpha: float | None = None, padding_free: bool = False) -> torch.Tensor:
    """`sequence_logps` (sums; LD-DPO's with `ld_alpha`) under the reference, counted in REFERENCE_FORWARDS:
    (rows,)."""
    global REFERENCE_FORWARDS
    REFERENCE_FORWARDS += 1
    return sequence_logps(ref, batch, chunked=chunked, pairs=pairs, ld_alpha=ld_alpha, padding_free=padding_free)


@torch.no_grad()
def reference_logps_table(model, tokenizer, rows: list[dict], *, max_length: int, batch_size: int = 8,
                          average: bool = False, device: str | torch.device | None = None,
                          chunked: bool = True, ld_alpha: float | None = None) -> torch.Tensor:
    """Reference log-probs of every pair, one no-grad pass: (N, 2) = [ref_chosen_logps, ref_rejected_logps].

    model: the reference itself (e.g. the SFT model, or a PEFT model inside `disable_adapter()`);
    rows: prompt/chosen/rejected rows or `tokenize_pairs` output. Sums over the completion tokens
    (the form the trainer's REF_COLUMNS take; LD-DPO's weighted sums with `ld_alpha`); average=True divides by
    the token counts.
    Runs in eval mode and restores the model's mode afterwards.
    """
    if rows and "chosen_input_ids" not in rows[0]:
        rows = tokenize_pairs(tokenizer, rows, max_length)
    collate = PairCollator(tokenizer.pad_token_id)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size]).items()}
            logps = reference_sequence_logps(model, batch, chunked=chunked, pairs=True, ld_alpha=ld_alpha)
            if average:
                logps = logps / completion_token_counts(batch).clamp(min=1)
            out.append(torch.stack(logps.chunk(2), dim=1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2)


def compute_reference_logps(model, tokenizer, rows: list[dict], *, max_length: int, batch_size: int = 8,
                            device: str | torch.device | None = None, chunked: bool = True,
                            ld_alpha: float | None = None) -> list[dict]:
    """`rows` with REF_COLUMNS added (summed log-probs, see `reference_logps_table`): what DPOTrainer
    reads instead of running a reference. Valid for training with the same tokenizer, max_length and ld_alpha."""
    table = reference_logps_table(model, tokenizer, rows, max_length=max_length, batch_size=batch_size,
                                  device=device, chunked=chunked, ld_alpha=ld_alpha)
    return [{**r, REF_COLUMNS[0]: c, REF_COLUMNS[1]: rj} for r, (c, rj) in zip(rows, table.tolist(), strict=True)]



class PrecomputedReference:
    """Reference log-probs stored as dataset columns (`ref_columns`), computed by one reference pass before
    training (`precompute_ref_log_probs`); shared by DPOTrainer and KTOTrainer, which say how a dataset gets its
    columns (`_with_reference(data, ref, batch_size)`)."""

    ref_columns: tuple[str, ...]
    model: Any  # what the Trainer it is mixed into holds
    args: Any
    train_dataset: Any
    eval_dataset: Any

    def _with_reference(self, data, ref, batch_size: int):
        raise NotImplementedError  # the trainer's: `data` with the reference columns added

    def _datasets(self) -> list:
        """The training dataset and every evaluation dataset (eval_dataset may be a dict of them)."""
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        return [d for d in (self.train_dataset, *evals) if d is not None]

    def _has_ref_columns(self) -> bool:
        return all(set(self.ref_columns) <= set(d.column_names) for d in self._datasets())

    def _precompute_reference(self, ref_model) -> None:
        """Add the reference columns to the datasets: one reference pass; the policy at step 0 is the reference."""
        ref = ref_model if ref_model is not None or is_peft(self.model) else unwrap(self.model)
        train_batch = self.args.precompute_ref_batch_size or self.args.per_device_train_batch_size
        eval_batch = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
        self.train_dataset = self._with_reference(self.train_dataset, ref, train_batch)
        evals = self.eval_dataset  # one dataset, or a dict of them
        self.eval_dataset = ({k: self._with_reference(d, ref, eval_batch) for k, d in evals.items()}
                             if isinstance(evals, dict) else self._with_reference(evals, ref, eval_batch))
