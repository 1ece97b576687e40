"""`GRPOConfig`: group relative policy optimisation's settings, TRL's names, one declaration
(`stages.trainers.grpo_trainer`).

The choices of `loss_type`, `scale_rewards` and `importance_sampling_level` are the keys of
`stages.losses.GRPO_AGGREGATIONS`, `GRPO_REWARD_SCALES` and `IMPORTANCE_SAMPLING_LEVELS` (tests keep them equal).
`use_vllm=True, vllm_mode="server"` samples from a vLLM OpenAI-compatible server (`vllm serve`, the generation
backend "vllm") at `vllm_server_base_url`, or http://`vllm_server_host`:`vllm_server_port`/v1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from stages.fields import check_fields, deprecated, non_negative, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    ContinuousBatchingFields,
    GenerationBatchFields,
    SamplingFields,
    chunked_field,
    pad_to_multiple_of_field,
    router_aux_loss_coef_field,
    sampling_renames,
    tis_cap_field,
    tis_warn_field,
)
from stages.trainers.pipeline_section import RewardKeys, ToolKeys, TrainingStage, section, stage_default
from stages.trainers.tool_fields import ToolFields

TrainingArguments = training_arguments()
_BASE_URL_HELP = ("base URL of the vLLM server, e.g. http://host:8000/v1 (null: http://127.0.0.1:8000/v1, or "
                  "vllm_server_host and vllm_server_port with use_vllm)")


@refuses_trl_fields
@dataclass
class GRPOConfig(MethodConfig, GenerationBatchFields, ContinuousBatchingFields, SamplingFields, ToolFields,
                 TrainingArguments):
    """`per_device_train_batch_size` counts completions, as in TRL: num_generations per prompt."""

    SAMPLES = "num_generations"

    num_generations: int = param(4, help="completions per prompt (the group)", check=lambda v: v >= 2,
                                 rule="must be >= 2 (advantages compare completions within a group)")
    max_completion_length: int = positive(32, "generation budget per completion (tokens)")
    beta: float = non_negative(0.0, "k3 KL strength to the reference (0: no reference model)")
    epsilon: float = non_negative(0.2, "lower clip of the importance ratio; 0.2 is typical")
    epsilon_high: float | None = param(None, help="upper clip (null: epsilon; DAPO uses 0.28)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo"] = param(
        "grpo", help="the loss: grpo, bnpo, dr_grpo, dapo, luspo aggregate the clipped ratio differently; sapo, "
        "cispo, vespo replace the clip (stages.losses.grpo_loss)")
    scale_rewards: Literal["group", "batch", "none"] = param("group", help="divide advantages by this std")
    importance_sampling_level: Literal["token", "sequence"] = param(
        "token", help="token: one importance ratio per token; sequence: the geometric mean over the completion, "
        "one per sequence (GSPO)")
    delta: float | None = param(None, help="cap on the unclipped importance ratio (two-sided clipping, "
                                "INTELLECT-2; recommended above 1 + epsilon_high); null: off", check=lambda v: v > 0,
                                rule="must be > 0 or null")
    sapo_temperature_pos: float = positive(1.0, "loss_type sapo: slope of the soft gate for positive advantages")
    sapo_temperature_neg: float = positive(1.05, "loss_type sapo: slope of the soft gate for negative advantages")
    vespo_k_pos: float = non_negative(2.0, "loss_type vespo: shape k of the gamma weight, advantages >= 0")
    vespo_lambda_pos: float = non_negative(3.0, "loss_type vespo: rate lambda of the gamma weight, advantages >= 0")
    vespo_k_neg: float = non_negative(3.0, "loss_type vespo: shape k of the gamma weight, advantages < 0")
    vespo_lambda_neg: float = non_negative(2.0, "loss_type vespo: rate lambda of the gamma weight, advantages < 0")
    off_policy_mask_threshold: float | None = param(
        None, help="drop a completion with a negative advantage whose sampler drifted from the policy by more than "
        "this mean per-token KL (DeepSeek-V3.2; e.g. 0.5); null: off", check=lambda v: v >= 0,
        rule="must be >= 0 or null")
    use_bias_correction_kl: bool = param(True, help="multiply the KL term by the importance ratio, so its gradient "
                                         "is the unbiased reverse-KL gradient (changes the gradient on policy too)")
    top_entropy_quantile: float = param(1.0, help="policy loss on the top share of tokens by entropy only (0.2 in "
                                        "'Beyond the 80/20 rule'; 1: every token)", check=lambda v: 0 <= v <= 1,
                                        rule="must be in [0, 1]")
    entropy_coef: float = non_negative(0.0, "entropy bonus: the loss subtracts this times the mean token entropy "
                                       "(the starting value with use_adaptive_entropy)")
    use_adaptive_entropy: bool = param(False, help="raise entropy_coef by entropy_coef_delta after a step whose "
                                       "entropy is <= entropy_target, lower it otherwise; the bonus applies only "
                                       "while the last step's entropy was <= entropy_target")
    entropy_coef_min: float = non_negative(0.0, "use_adaptive_entropy: lowest entropy_coef")
    entropy_coef_max: float = non_negative(1.0, "use_adaptive_entropy: highest entropy_coef")
    entropy_coef_delta: float = non_negative(0.005, "use_adaptive_entropy: change of entropy_coef per step")
    entropy_target: float = non_negative(0.2, "use_adaptive_entropy: the entropy (nats per token) to hold")
    num_iterations: int = positive(1, "updates per generation (importance ratio to the sampling policy)")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = param(
        "sum_then_normalize", help="several reward functions: weight and sum the rewards, then normalise "
        "(sum_then_normalize), or normalise each function's rewards in its groups, then weight and sum "
        "(normalize_then_sum, GDPO)")
    chat_template_kwargs: dict | None = param(None, help="extra arguments of the chat template when prompts are "
                                              "rendered (e.g. {enable_thinking: false})")
    num_generations_eval: int | None = param(None, help="completions per prompt in evaluation (null: "
                                             "num_generations)", check=lambda v: v >= 1, rule="must be >= 1 or null")
    log_completions: bool = param(False, help="log a table of prompts, completions, rewards and advantages every "
                                  "logging_steps (to the trackers that take tables, and printed)")
    num_completions_to_print: int | None = param(None, help="log_completions: rows printed (null: all)",
                                                 check=lambda v: v >= 0, rule="must be >= 0 or null")
    log_unique_prompts: bool = param(False, help="log_completions: print one row per prompt only")
    log_multimodal: bool = param(True, help="log_completions: TRL also logs the prompts' images; prompts are text "
                                 "only here, so there are none to log")
    router_aux_loss_coef: float | None = router_aux_loss_coef_field()
    cast_lm_head_to_fp32: bool = param(False, help="the language-model head of the policy and reference in float32, "
                                       "from float32 hidden states (ScaleRL)")
    disable_dropout: bool = param(False, help="dropout off in the policy and reference (nn.Dropout and attention "
                                  "dropout), so sampling-time and update log-probs agree")
    shuffle_dataset: bool = param(True, help="shuffle the training prompts each epoch (false: dataset order)")
    sync_ref_model: bool = param(False, help="TR-DPO: every ref_model_sync_steps steps the reference becomes "
                                 "ref_model_mixup_alpha x policy + (1 - alpha) x reference (needs beta > 0)")
    ref_model_mixup_alpha: float = param(0.6, help="sync_ref_model: the policy's share in the new reference",
                                         check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]")
    ref_model_sync_steps: int = positive(512, "sync_ref_model: optimizer steps between reference updates")
    use_vllm: bool = param(False, help="sample from a vLLM server (vllm_mode server; an OpenAI-compatible "
                           "`vllm serve` whose weights training does not update: see vllm_importance_sampling_cap)")
    vllm_mode: Literal["server", "colocate"] = param("colocate", help="use_vllm: server (supported) or colocate "
                                                      "(TRL's in-process engine: not built here)")
    vllm_server_host: str = param("127.0.0.1", help="use_vllm: host of the vLLM server (when vllm_server_base_url "
                                  "is null)")
    vllm_server_port: int = param(8000, help="use_vllm: port of the vLLM server", check=lambda v: 0 < v < 65536,
                                  rule="must be a TCP port, 1-65535")
    vllm_server_timeout: float = positive(240.0, "use_vllm: seconds to wait for the vLLM server to answer before "
                                          "training starts")
    # TRL's default, None (host and port), where SamplingFields has a URL: a wider type than the base's
    vllm_server_base_url: str | None = param(None, help=_BASE_URL_HELP)  # type: ignore[assignment]
    mask_truncated_completions: bool = param(False, help="no loss on completions cut at max_completion_length")
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    reward_head: Literal["separate", "shared"] = param("separate", help="shared: the policy trains its own reward "
                                                       "head on preference pairs in the same update (self-rewarding)")
    reward_head_coef: float = non_negative(1.0, "reward_head shared: weight of the head's Bradley-Terry loss")
    reward_head_weight: float = param(1.0, help="reward_head shared: weight of the head's score in the reward")
    reward_head_batch_size: int = positive(8, "reward_head shared: preference pairs per step for the head")
    max_length: int = positive(512, "reward_head shared: truncate preference prompt + completion (tokens)")
    vllm_importance_sampling_cap: float | None = tis_cap_field()
    vllm_importance_sampling_correction: bool = param(True, help="weight the policy-gradient term by pi/mu where "
                                                      "the sampler's own log-probs are known (backend vllm); false: "
                                                      "never")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        param("token_truncate", help="per token or per sequence ratio; truncate clamps it to [clip_min, clip_max], "
              "mask drops the token or sequence outside (stages.losses.sampler_importance_weights; TRL's default "
              "is sequence_mask)")
    vllm_importance_sampling_clip_max: float | None = param(
        None, help="upper bound of the importance weight (null: vllm_importance_sampling_cap)", check=lambda v: v > 0,
        rule="must be > 0 or null")
    vllm_importance_sampling_clip_min: float | None = param(
        None, help="lower bound of the importance weight (null: none)", check=lambda v: v >= 0,
        rule="must be >= 0 or null")
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
        problems += self.generation_batch_problems() + self.continuous_batching_problems()
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            problems.append(("entropy_coef", f"= {self.entropy_coef}: with use_adaptive_entropy it starts within "
                             f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min}, "
                             f"{self.entropy_coef_max}]"))
        if self.use_vllm and self.vllm_mode != "server":
            problems.append(("vllm_mode", f"= {self.vllm_mode!r}: TRL's colocated vLLM engine (and its weight sync) "
                             "is not built; set vllm_mode: server and start an OpenAI-compatible `vllm serve` "
                             "(stages.generation.vllm.serve_command)"))
        if self.sync_ref_model and self.beta == 0:
            problems.append(("sync_ref_model", "= True but beta = 0: there is no reference to move; set beta > 0 "
                             "(e.g. 0.04) or sync_ref_model: false"))
        low, high = self.importance_sampling_bounds
        if low is not None and high is not None and low >= high:
            problems.append(("vllm_importance_sampling_clip_min", f"= {low}: must be below the upper bound {high} "
                             "(vllm_importance_sampling_clip_max, else vllm_importance_sampling_cap)"))
        if self.use_vllm and self.generation_backend not in ("auto", "vllm"):
            problems.append(("use_vllm", f"= True but generation_backend = {self.generation_backend!r}: use_vllm "
                             "samples with the vllm backend; drop one of them"))
        return problems

    @property
    def importance_sampling_bounds(self) -> tuple[float | None, float | None]:
        """(lowest, highest) importance weight: clip_min, and clip_max else vllm_importance_sampling_cap."""
        high = self.vllm_importance_sampling_clip_max
        return self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_cap if high is None else high

    @property
    def importance_sampling_on(self) -> bool:
        """Whether the sampler correction weights the loss: switched on, with at least one bound."""
        return self.vllm_importance_sampling_correction and self.importance_sampling_bounds != (None, None)

    @property
    def vllm_url(self) -> str:
        """The vLLM server's OpenAI base URL: vllm_server_base_url, else host and port (use_vllm), else the default."""
        if self.vllm_server_base_url:
            return self.vllm_server_base_url
        if self.use_vllm:
            host = self.vllm_server_host or "127.0.0.1"
            return f"http://{host}:{self.vllm_server_port}/v1"
        return "http://127.0.0.1:8000/v1"

    def sampling_settings(self) -> dict[str, Any]:
        s = super().sampling_settings()
        return {**s, "backend": "vllm" if self.use_vllm else s["backend"], "vllm_url": self.vllm_url}


def _processes(config) -> int:
    """Data-parallel processes of a real config (TrainingArguments.world_size); 1 for a light one (params)."""
    return getattr(config, "world_size", 1) or 1


@section
class GRPOSection(ToolKeys, RewardKeys, TrainingStage, GRPOConfig):
    """Section `policy.grpo`: stages.trainers.grpo_config.GRPOConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (GRPOSection there, each with why)."""

    learning_rate: float = stage_default(3e-4, "chosen on the built-in task's dev split (docs/methods.md) at 150 steps")
    per_device_train_batch_size: int = stage_default(128, "completions per step: 32 prompts x num_generations 4, the "
                                                          "budget dev chose; the Python API keeps TrainingArguments' "
                                                          "8, as TRL's GRPOConfig")
    max_steps: int = stage_default(150, "the budget the learning rate was chosen at")
    reward_functions: list[str] = stage_default(["exact_match"], "the built-in task's answers are checkable")
