"""`PPOConfig`: proximal policy optimisation's settings, TRL's names, one declaration (`stages.trainers.ppo_trainer`).

`per_device_train_batch_size` prompts per rollout. The choices of `kl_estimator` are the keys of
`stages.losses.KL_ESTIMATORS` (a test keeps them equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import check_fields, deprecated, fraction, non_negative, param, positive
from stages.reward_function_names import VERIFIED_FIRST_WEIGHTS
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import SamplingFields, chunked_field, sampling_renames, tis_cap_field, tis_warn_field
from stages.trainers.pipeline_section import RewardKeys, TrainingStage, section, stage_default

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class PPOConfig(MethodConfig, SamplingFields, TrainingArguments):
    num_ppo_epochs: int = positive(4, "optimisation passes over each rollout batch")
    num_mini_batches: int = positive(1, "minibatches (optimizer steps) per PPO epoch; divides the batch size")
    kl_coef: float = non_negative(0.05, "per-token KL penalty to the reference")
    kl_estimator: Literal["k1", "k3"] = param("k1", help="per-token KL estimator")
    cliprange: float = positive(0.2, "policy ratio clip")
    cliprange_value: float = positive(0.2, "value clip around the rollout values")
    vf_coef: float = non_negative(0.1, "value loss weight")
    gamma: float = fraction(1.0, "discount (1.0: none, the usual for text)", open_right=False)
    lam: float = fraction(0.95, "GAE lambda", open_right=False)
    whiten_rewards: bool = param(False, help="whiten the per-token rewards of each batch")
    missing_eos_penalty: float | None = param(1.0, help="subtracted from the score of completions without EOS "
                                              "(null: none)", check=lambda v: v >= 0, rule="must be >= 0 or null")
    max_completion_length: int = positive(64, "rollout budget per completion (tokens; offline: cuts the given "
                                          "completions)")
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    vllm_importance_sampling_cap: float | None = tis_cap_field()
    tis_warn: float = tis_warn_field()
    disable_dropout: bool = param(True, help="dropout off, so rollout and update log-probs agree")
    use_chunked_logprobs: bool = chunked_field()
    generation: dict | None = deprecated(sampling_renames("max_completion_length"), "the old nested sampling section")
    tis_cap: float | None = deprecated("vllm_importance_sampling_cap", "the old name of vllm_importance_sampling_cap")

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, PPOConfig)
        batch = self.per_device_train_batch_size
        if batch % self.num_mini_batches:
            problems.append(("per_device_train_batch_size", f"= {batch} is not divisible by num_mini_batches = "
                             f"{self.num_mini_batches}: every minibatch must hold the same number of rollouts"))
        if self.gradient_accumulation_steps != 1:
            problems.append(("gradient_accumulation_steps", f"= {self.gradient_accumulation_steps}: must be 1; PPO "
                             "makes num_ppo_epochs x num_mini_batches optimizer steps per rollout batch itself (raise "
                             "num_mini_batches to use less memory per step)"))
        return problems


@section
class PPOSection(RewardKeys, TrainingStage, PPOConfig):
    """Section `policy.ppo`: stages.trainers.ppo_config.PPOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (PPOSection there, each with why)."""

    learning_rate: float = stage_default(3e-5, "chosen on the built-in task's dev split (docs/methods.md)")
    reward_weights: list[float] | None = stage_default(list(VERIFIED_FIRST_WEIGHTS), "the verifiable reward decides, "
                                                                                     "the reward model breaks ties "
                                                                                     "(RewardKeys' default functions)")
