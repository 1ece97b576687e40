"""The reward model's settings: the method fields of `RewardConfig` and of params.yaml's `reward` section.

`RewardConfig` (stages.trainers.reward) is this class combined with `transformers.TrainingArguments`;
the `reward` section is this class plus the shared training settings and the pipeline's
held-out split, quality gate and calibration table. No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from stages.fields import check_fields, param, positive


@dataclass
class RewardModelParams:
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    center_rewards_coefficient: float | None = param(None, help="weight of mean((r_c + r_r)^2), keeps rewards "
                                                     "centred at 0 (null: off; 0.01 is typical)",
                                                     check=lambda v: math.isfinite(v) and v >= 0,
                                                     rule="must be >= 0 and finite, or null")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, RewardModelParams)
