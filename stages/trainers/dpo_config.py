"""`DPOConfig`: direct preference optimisation's settings, TRL's names, one declaration (`stages.trainers.dpo_trainer`).

`beta` defaults to 0.3 (TRL: 0.1), chosen on the built-in task's dev split (docs/methods.md). The
objectives named in `loss_type` are resolved (and so checked to exist) by the trainer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from stages.fields import check_fields, param, positive
from stages.trainers.arguments import MethodConfig, is_light, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    RefSyncFields,
    TokenizerFields,
    activation_offloading_field,
    beta_field,
    chunked_field,
    disable_dropout_field,
    f_divergence_problems,
    loss_type_field,
    num_proc_field,
    objective_names,
    objectives_problems,
    pad_multiple,
    pad_to_multiple_of_field,
    precompute_ref_batch_size_field,
    router_aux_loss_coef_field,
    truncation_mode_field,
)
from stages.trainers.pipeline_section import TrainingStage, section

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class DPOConfig(MethodConfig, TokenizerFields, RefSyncFields, TrainingArguments):
    beta: float = beta_field()
    loss_type: str | list[str] = loss_type_field()
    loss_weights: list[float] | None = param(None, help="weights of the loss_type list (null: all 1.0)")
    label_smoothing: float = param(0.0, help="conservative DPO / robust noise rate", check=lambda v: 0 <= v < 0.5,
                                   rule="must be in [0, 0.5)")
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = param(
        "reverse_kl", help="the f-divergence of f-DPO (arXiv:2309.16240) that scores each log-ratio; reverse_kl "
        "is DPO's own (stages.losses.F_DIVERGENCES)")
    f_alpha_divergence_coef: float = param(0.5, help="α of f_divergence_type alpha_divergence")
    discopop_tau: float = positive(0.05, "temperature of loss_type discopop's blend of logistic and exponential "
                                   "losses (DiscoPOP, arXiv:2406.08414)")
    ld_alpha: float | None = param(None, help="LD-DPO (arXiv:2409.06411): scale the log-probs of each completion's "
                                   "tokens past the pair's shared length (the shorter completion's) by this; 1.0 is "
                                   "plain DPO, 0.0 drops the longer completion's tail; null: off. Applies to the "
                                   "reference log-probs too (precomputed ones must use the same value)",
                                   check=lambda v: 0 <= v <= 1, rule="must be in [0, 1] (or null: off)")
    use_weighting: bool = param(False, help="WPO (arXiv:2406.11827): weight each pair's loss by the policy's "
                                "length-normalised probability of its chosen and rejected completions (detached); "
                                "needs the full next-token distribution, so use_chunked_logprobs is bypassed")
    reference_free: bool = param(False, help="no reference model (its log-probs taken as 0)")
    disable_dropout: bool = disable_dropout_field()
    precompute_ref_log_probs: bool = param(True, help="compute the reference log-probs once before training (TRL's "
                                           "default: false; the pipeline caches them in stage `reference`, so a "
                                           "rerun with another beta or loss_type skips them); ignored with "
                                           "reference_free")
    precompute_ref_batch_size: int | None = precompute_ref_batch_size_field()
    padding_free: bool = param(False, help="run each batch as one row without padding: every pair packed on its "
                               "shared prefix (stages.pair_packing) and the pairs joined, kept apart by a "
                               "block-diagonal attention mask; needs sdpa or eager attention on an unsharded model "
                               "(an error otherwise; TRL 1.16 falls back to padding with a warning)")
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    truncation_mode: Literal["keep_start"] = truncation_mode_field()
    dataset_num_proc: int | None = num_proc_field()
    task_weights: dict[str, float] | None = param(None, help="loss scale per value of the rows' `task` column "
                                                  "(multi-task mixtures; tasks not listed: 1.0)")
    balance_column: str | None = param(None, help="draw batches balanced over this column (task, source, prompt)")
    activation_offloading: bool = activation_offloading_field()
    router_aux_loss_coef: float | None = router_aux_loss_coef_field()
    use_chunked_logprobs: bool = chunked_field()

    @property
    def objective_names(self) -> list[str]:
        return objective_names(self.loss_type)

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, DPOConfig) + objectives_problems(self)
        problems += f_divergence_problems(self.f_divergence_type, self.objective_names, light=is_light(self))
        problems += self.ref_sync_problems()
        if self.padding_free and pad_multiple(self.pad_to_multiple_of) is not None:
            problems.append(("padding_free", f"= True with pad_to_multiple_of = {self.pad_to_multiple_of}: a batch "
                             "without padding has none to round up; drop one of them"))
        bad = {k: v for k, v in (self.task_weights or {}).items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            problems.append(("task_weights", f"= {self.task_weights}: {bad} must be finite numbers >= 0"))
        return problems


@section
class DPOSection(TrainingStage, DPOConfig):
    """Section `policy.dpo`: stages.trainers.dpo_config.DPOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (DPOSection there, each with why)."""
