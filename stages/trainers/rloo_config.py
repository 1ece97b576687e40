"""`RLOOConfig`: REINFORCE leave-one-out's settings, TRL 1.16's names, one declaration (`stages.trainers.rloo_trainer`).

`per_device_train_batch_size` counts completions, as in TRL: num_generations per prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stages.fields import check_fields, non_negative, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    ContinuousBatchingFields,
    GenerationBatchFields,
    SamplingFields,
    chunked_field,
    router_aux_loss_coef_field,
)
from stages.trainers.online_options import OnlineOptions
from stages.trainers.pipeline_section import RewardKeys, TrainingStage, section, stage_default

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class RLOOConfig(MethodConfig, OnlineOptions, GenerationBatchFields, ContinuousBatchingFields, SamplingFields,
                 TrainingArguments):
    """`per_device_train_batch_size` counts completions, as in TRL: num_generations per prompt."""

    SAMPLES = "num_generations"  # the sampling record's n (SamplingFields.sampling)

    # What GRPOTrainer's shared machinery (which RLOOTrainer extends) reads: no self-rewarding head here, and the
    # loss is a mean over sequences, so no dapo token count and no per-token importance correction.
    reward_head: ClassVar[str] = "separate"
    loss_type: ClassVar[str] = "rloo"
    vllm_importance_sampling_cap: ClassVar[None] = None
    tis_warn: ClassVar[float] = float("inf")
    # GRPO-only settings the shared machinery reads, at the values that switch them off for RLOO
    cast_lm_head_to_fp32: ClassVar[bool] = False
    entropy_coef: ClassVar[float] = 0.0
    use_adaptive_entropy: ClassVar[bool] = False
    top_entropy_quantile: ClassVar[float] = 1.0
    importance_sampling_on: ClassVar[bool] = False
    multi_objective_aggregation: ClassVar[str] = "sum_then_normalize"

    @property
    def vllm_url(self) -> str:
        """The vLLM server's OpenAI base URL (use_vllm), as the sampling settings hold it."""
        return self.sampling.vllm_url

    num_generations: int = param(2, help="completions per prompt (the group each leaves one out of)",
                                 check=lambda v: v >= 2, rule="must be >= 2 (the baseline is the other completions' "
                                 "mean reward)")
    num_generations_eval: int | None = param(None, help="completions per prompt when evaluating on eval_dataset (null: "
                                             "num_generations)", check=lambda v: v >= 1, rule="must be >= 1 or null")
    max_completion_length: int = positive(32, "generation budget per completion (tokens)")
    beta: float = non_negative(0.05, "KL strength: beta x the completion's summed log-ratio to the reference is "
                               "subtracted from its reward (0: no reference model)")
    num_iterations: int = positive(1, "updates per generation (importance ratio to the sampling policy)")
    epsilon: float = non_negative(0.2, "lower clip of the sequence importance ratio")
    epsilon_high: float | None = param(None, help="upper clip (null: epsilon)")
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    normalize_advantages: bool = param(False, help="scale the advantages of each rollout batch to mean 0, std 1")
    reward_clip_range: list[float] | None = param(
        None, help="clamp each total reward to [min, max] before the baseline (null: no clipping)")
    mask_truncated_completions: bool = param(False, help="no loss on completions cut at max_completion_length")
    sync_ref_model: bool = param(False, help="TR-DPO: every ref_model_sync_steps, move the reference towards the "
                                 "policy (needs beta > 0 and a reference copy, not PEFT)")
    ref_model_mixup_alpha: float = param(0.6, help="TR-DPO's alpha: ref = alpha x policy + (1 - alpha) x ref",
                                         check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]")
    ref_model_sync_steps: int = positive(512, "TR-DPO's tau: optimizer steps between reference updates")
    log_multimodal: bool = param(True, help="log images with completions (text-only trainer: nothing to add)")
    router_aux_loss_coef: float | None = router_aux_loss_coef_field()
    use_chunked_logprobs: bool = chunked_field()

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, RLOOConfig) + self.online_problems() + self.generation_batch_problems()
        problems += self.continuous_batching_problems()
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            problems.append(("epsilon_high", f"= {self.epsilon_high}: must be >= epsilon ({self.epsilon})"))
        batch = self.per_device_train_batch_size
        if self.num_generations >= 2 and batch % self.num_generations:
            problems.append(("per_device_train_batch_size", f"= {batch}: counts completions and must be divisible "
                             f"by num_generations = {self.num_generations}; use a multiple"))
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
            problems.append(("reward_clip_range", f"= {clip}: must be [min, max] with min <= max"))
        if self.sync_ref_model and self.beta == 0:
            problems.append(("sync_ref_model", "= True with beta = 0: there is no reference to sync; set beta > 0 "
                             "or sync_ref_model: false"))
        return problems


@section
class RLOOSection(RewardKeys, TrainingStage, RLOOConfig):
    """Section `policy.rloo`: stages.trainers.rloo_config.RLOOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (RLOOSection there, each with why)."""

    learning_rate: float = stage_default(3e-4, "GRPO's, not yet tuned on the dev split")
    per_device_train_batch_size: int = stage_default(128, "GRPO's budget (completions per step); the Python API keeps "
                                                          "TrainingArguments' 8, as TRL's RLOOConfig")
    max_steps: int = stage_default(150, "GRPO's budget")
    reward_functions: list[str] = stage_default(["exact_match"], "the built-in task's answers are checkable")
