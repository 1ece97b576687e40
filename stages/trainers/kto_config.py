"""`KTOConfig`: Kahneman-Tversky optimisation's settings, TRL's names, one declaration
(`stages.trainers.kto_trainer`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import check_fields, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    RefSyncFields,
    activation_offloading_field,
    beta_field,
    chunked_field,
    disable_dropout_field,
    num_proc_field,
    pad_to_multiple_of_field,
    precompute_ref_batch_size_field,
    router_aux_loss_coef_field,
)
from stages.trainers.pipeline_section import TrainingStage, section

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class KTOConfig(MethodConfig, RefSyncFields, TrainingArguments):
    beta: float = beta_field()
    loss_type: Literal["kto", "apo_zero_unpaired"] = param(
        "kto", help="kto: KTO around the batch KL reference point; apo_zero_unpaired: APO-zero on unpaired rows, "
        "no KL estimate (stages.losses.KTO_LOSSES)")
    desirable_weight: float = positive(1.0, "loss weight of desirable rows")
    undesirable_weight: float = positive(1.0, "loss weight of undesirable rows")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    dataset_num_proc: int | None = num_proc_field()
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    precompute_ref_log_probs: bool = param(False, help="compute the reference log-probs of every row (and of its KL "
                                           "pair) once before training, then drop the reference model; as in TRL, "
                                           "off by default")
    precompute_ref_batch_size: int | None = precompute_ref_batch_size_field()
    disable_dropout: bool = disable_dropout_field()
    activation_offloading: bool = activation_offloading_field()
    router_aux_loss_coef: float | None = router_aux_loss_coef_field()
    use_chunked_logprobs: bool = chunked_field()

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, KTOConfig) + self.ref_sync_problems()


@section
class KTOSection(TrainingStage, KTOConfig):
    """Section `policy.kto`: stages.trainers.kto_config.KTOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (KTOSection there, each with why)."""
