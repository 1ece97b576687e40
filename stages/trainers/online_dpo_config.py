"""`OnlineDPOConfig`: online DPO's settings, TRL's names, one declaration (`stages.trainers.online_dpo_trainer`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stages.fields import check_fields, deprecated, param, positive
from stages.reward_function_names import VERIFIED_FIRST_WEIGHTS
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    SamplingFields,
    beta_field,
    chunked_field,
    disable_dropout_field,
    loss_type_field,
    objective_names,
    objectives_problems,
    sampling_renames,
)
from stages.trainers.pipeline_section import RewardKeys, TrainingStage, section, stage_default

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class OnlineDPOConfig(MethodConfig, SamplingFields, TrainingArguments):
    MAX_TOKENS: ClassVar[str] = "max_new_tokens"
    SAMPLES = 2  # completions per prompt: the pair the reward functions rank

    beta: float | list[float] = beta_field(per_epoch=True)
    reward_model_path: str | None = param(None, help="a reward model's folder that ranks the samples when "
                                          "reward_funcs is not given to the trainer")
    missing_eos_penalty: float | None = param(None, help="subtracted from the score of a completion that has no EOS "
                                              "(cut at max_new_tokens), so shorter answers that end win (null: none)",
                                              check=lambda v: v >= 0, rule="must be >= 0 or null")
    disable_dropout: bool = disable_dropout_field()
    loss_type: str | list[str] = loss_type_field()
    loss_weights: list[float] | None = param(None, help="weights of the loss_type list (null: all 1.0)")
    max_new_tokens: int = positive(64, "generation budget per completion (tokens)")
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    use_chunked_logprobs: bool = chunked_field()
    generation: dict | None = deprecated(sampling_renames("max_new_tokens"), "the old nested sampling section")

    @property
    def objective_names(self) -> list[str]:
        return objective_names(self.loss_type)

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, OnlineDPOConfig) + objectives_problems(self)
        return problems


@section
class OnlineDPOSection(RewardKeys, TrainingStage, OnlineDPOConfig):
    """Section `policy.online_dpo`: stages.trainers.online_dpo_config.OnlineDPOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (OnlineDPOSection there, each with why)."""

    learning_rate: float = stage_default(1e-4, "chosen on the built-in task's dev split (docs/methods.md)")
    reward_weights: list[float] | None = stage_default(list(VERIFIED_FIRST_WEIGHTS), "the verifiable reward decides, "
                                                                                     "the reward model breaks ties "
                                                                                     "(RewardKeys' default functions)")
