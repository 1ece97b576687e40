"""`KTOConfig`: Kahneman-Tversky optimisation's settings, TRL's names, one declaration (`stages.trainers.kto_trainer`)."""
from __future__ import annotations

from dataclasses import dataclass

from stages.fields import check_fields, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import beta_field, chunked_field, num_proc_field

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class KTOConfig(MethodConfig, TrainingArguments):
    beta: float = beta_field()
    desirable_weight: float = positive(1.0, "loss weight of desirable rows")
    undesirable_weight: float = positive(1.0, "loss weight of undesirable rows")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    dataset_num_proc: int | None = num_proc_field()
    use_chunked_logprobs: bool = chunked_field()

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, KTOConfig)
