"""`GRPOConfig`: group relative policy optimisation's settings, TRL's names, one declaration (`stages.trainers.grpo_trainer`).

The choices of `loss_type` and `scale_rewards` are the keys of `stages.losses.GRPO_AGGREGATIONS`
and `GRPO_REWARD_SCALES` (a test keeps them equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import check_fields, deprecated, non_negative, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import SamplingFields, chunked_field, sampling_renames, tis_cap_field, tis_warn_field

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class GRPOConfig(MethodConfig, SamplingFields, TrainingArguments):
    """`per_device_train_batch_size` counts completions, as in TRL: num_generations per prompt."""

    num_generations: int = param(4, help="completions per prompt (the group)", check=lambda v: v >= 2,
                                 rule="must be >= 2 (advantages compare completions within a group)")
    max_completion_length: int = positive(32, "generation budget per completion (tokens)")
    beta: float = non_negative(0.0, "k3 KL strength to the reference (0: no reference model)")
    epsilon: float = non_negative(0.2, "lower clip of the importance ratio; 0.2 is typical")
    epsilon_high: float | None = param(None, help="upper clip (null: epsilon; DAPO uses 0.28)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = param("grpo", help="token aggregation of the loss")
    scale_rewards: Literal["group", "batch", "none"] = param("group", help="divide advantages by this std")
    num_iterations: int = positive(1, "updates per generation (importance ratio to the sampling policy)")
    mask_truncated_completions: bool = param(False, help="no loss on completions cut at max_completion_length")
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    reward_head: Literal["separate", "shared"] = param("separate", help="shared: the policy trains its own reward "
                                                       "head on preference pairs in the same update (self-rewarding)")
    reward_head_coef: float = non_negative(1.0, "reward_head shared: weight of the head's Bradley-Terry loss")
    reward_head_weight: float = param(1.0, help="reward_head shared: weight of the head's score in the reward")
    reward_head_batch_size: int = positive(8, "reward_head shared: preference pairs per step for the head")
    max_length: int = positive(512, "reward_head shared: truncate preference prompt + completion (tokens)")
    vllm_importance_sampling_cap: float | None = tis_cap_field()
    tis_warn: float = tis_warn_field()
    use_chunked_logprobs: bool = chunked_field()
    generation: dict | None = deprecated(sampling_renames("max_completion_length"), "the old nested sampling section")
    tis_cap: float | None = deprecated("vllm_importance_sampling_cap", "the old name of vllm_importance_sampling_cap")

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, GRPOConfig)
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            problems.append(("epsilon_high", f"= {self.epsilon_high}: must be >= epsilon ({self.epsilon}); the "
                             "upper clip range is at least the lower one (DAPO's clip-higher uses 0.28 with 0.2)"))
        batch = self.per_device_train_batch_size
        if self.num_generations >= 2 and batch % self.num_generations:
            problems.append(("per_device_train_batch_size", f"= {batch}: counts completions and must be divisible "
                             f"by num_generations = {self.num_generations} (batch / num_generations prompts x "
                             "num_generations completions); use a multiple"))
        return problems
