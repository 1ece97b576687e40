"""`RewardConfig`: the reward model's settings, TRL's names, one declaration (`stages.trainers.reward_trainer`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from stages.fields import check_fields, fraction, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    TokenizerFields,
    activation_offloading_field,
    disable_dropout_field,
    num_proc_field,
    pad_to_multiple_of_field,
)
from stages.trainers.pipeline_section import TrainingStage, section, stage_default

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


@dataclass
class RewardStage:
    """The keys of section `reward` beyond RewardConfig's."""

    eval_fraction: float = param(0.1, help="share of pairs held out for accuracy and calibration",
                                 check=lambda v: 0 < v < 1, rule="must be in (0, 1)")
    min_accuracy: float = fraction(0.85, "quality gate: the held-out pair accuracy's lower confidence bound "
                                   "(reward.gate_confidence) below this fails the stage and stops everything "
                                   "downstream (0: no gate; stages/gates.py). 0.85 at 95%: on 270 pairs a "
                                   "measured 0.889 passes, and at least 16 pairs are needed", open_right=False)
    gate_confidence: float = param(0.95, help="confidence of the gate's one-sided Wilson lower bound (0.5: judge "
                                   "the accuracy itself)", check=lambda v: 0.5 <= v < 1, rule="must be in [0.5, 1)")
    calibration_bins: int = positive(10, "bins of the reliability table (confidence in the preferred side, "
                                     "σ(|r_c - r_r|) over [0.5, 1], vs how often it is right)")


@section
class RewardSection(RewardStage, TrainingStage, RewardConfig):
    """Section `reward`: stages.trainers.reward_config.RewardConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (RewardSection there, each with why)."""

    learning_rate: float = stage_default(6e-4, "with 8 epochs: the fewest that passed the gate on seeds 0-3 "
                                               "(docs/methods.md)")
    num_train_epochs: float = stage_default(8.0, "the fewest epochs that passed the gate on seeds 0-3 "
                                                 "(docs/methods.md)")
    per_device_train_batch_size: int = stage_default(8, "pairs per step: the batch the gate recipe was measured with")
