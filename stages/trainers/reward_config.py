"""`RewardConfig`: the reward model's settings, TRL's names, one declaration (`stages.trainers.reward_trainer`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from stages.fields import check_fields, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    TokenizerFields,
    activation_offloading_field,
    disable_dropout_field,
    num_proc_field,
    pad_to_multiple_of_field,
)

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class RewardConfig(MethodConfig, TokenizerFields, TrainingArguments):
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    center_rewards_coefficient: float | None = param(None, help="weight of mean((r_c + r_r)^2), keeps rewards "
                                                     "centred at 0 (null: off; 0.01 is typical)",
                                                     check=lambda v: math.isfinite(v) and v >= 0,
                                                     rule="must be >= 0 and finite, or null")
    dataset_num_proc: int | None = num_proc_field()
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    disable_dropout: bool = disable_dropout_field()
    activation_offloading: bool = activation_offloading_field()

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, RewardConfig)
