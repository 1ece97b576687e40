"""TRL 1.16 names that `stages.trainers` does not support yet, and the error for setting one.

Our trainers and configs take TRL 1.16's argument and field names (tests/stages/trainers/
test_trl_compat.py walks TRL's own signatures and dataclasses and fails on any TRL name that
is neither ours nor listed here, and on any entry here that is no longer needed). A TRL name
listed here is never silently ignored: a trainer argument we accept by name only raises when
given, and a config key gets the error of `unsupported_trl_fields` (configs and params.yaml).

Keys: "name" for every TRL trainer or config that has it, "Class.name" for one (e.g.
"KTOConfig.loss_type"); a "Class.name" we have with a narrower type than TRL's (OnlineDPOConfig.beta:
a float, TRL also takes a list) is listed for the part we lack. Values: why, and what to do instead.
No TRL import here (torch-free).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

TRL_VERSION = "1.16"

_VLLM = ("vLLM is reached as a separate OpenAI-compatible server (the generation backend 'vllm'); TRL's colocated "
         "engine and weight sync are not built")
_SAMPLER = "the sampler (stages.generation) takes temperature, top_p and top_k only"
_TR_DPO = "TR-DPO's reference syncing is not built (the reference stays the starting model)"
_ENTROPY = "entropy terms in the loss are not built (the entropy is logged)"
_LOG = "completions are not logged or printed by the trainer"
_GRPO_LOSS = "this GRPO loss variant is not built (loss_type: grpo, bnpo, dr_grpo, dapo)"
_IS = ("the importance-sampling correction is always on, per token, truncated at vllm_importance_sampling_cap "
       "(TRL's token_truncate)")
_NO_METRICS = "evaluation returns the loss and the method's metrics only, no predictions for compute_metrics"

UNSUPPORTED: dict[str, str] = {
    # ---- every config or trainer of TRL that has the name
    "model_init_kwargs": "the configs do not declare it yet: load the model with from_pretrained(...) and pass it",
    "trust_remote_code": "the configs do not declare it yet: pass a model and processing_class loaded with "
                         "trust_remote_code enabled",
    "use_liger_kernel": "Liger kernels are not built; the losses use our own chunked log-prob kernel",
    "liger_kernel_config": "Liger kernels are not built; the losses use our own chunked log-prob kernel",
    "router_aux_loss_coef": "the Mixture-of-Experts load-balancing loss is not added to our losses",
    "chat_template_path": "set tokenizer.chat_template and pass the tokenizer as processing_class",
    "eos_token": "set the tokenizer's eos_token and pass the tokenizer as processing_class",
    "pad_token": "set tokenizer.pad_token and pass the tokenizer as processing_class (deprecated in TRL too)",
    "pad_to_multiple_of": "batches are padded to their longest row",
    "activation_offloading": "offloading activations to the CPU is not built",
    "disable_dropout": "dropout stays as the model's config sets it (only PPOConfig has disable_dropout)",
    "truncation_mode": "rows are always cut at the end (TRL's keep_start, its only non-deprecated mode)",
    "shuffle_dataset": "the training rows are always shuffled",
    "padding_free": "SFT batches go padding-free by themselves with packing and flash attention; DPO packs each pair "
                    "on its shared prefix instead",
    "sync_ref_model": _TR_DPO, "ref_model_mixup_alpha": _TR_DPO, "ref_model_sync_steps": _TR_DPO,
    "min_p": _SAMPLER, "repetition_penalty": _SAMPLER, "generation_kwargs": _SAMPLER,
    "cache_implementation": _SAMPLER,
    "use_vllm": _VLLM, "vllm_mode": _VLLM, "vllm_model_impl": _VLLM, "vllm_structured_outputs_regex": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM, "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM, "vllm_server_timeout": _VLLM, "vllm_group_port": _VLLM,
    "vllm_tensor_parallel_size": _VLLM, "vllm_enable_sleep_mode": _VLLM, "vllm_max_model_length": _VLLM,
    "ds3_gather_for_generation": "DeepSpeed ZeRO-3 is not used",
    "reward_processing_classes": "a reward model in reward_funcs is given as its folder, whose tokenizer it uses",
    # ---- one trainer or config
    "SFTConfig.loss_type": "SFT's loss is the token-mean negative log-likelihood; TRL's 'dft' is not built",
    "SFTConfig.dataset_kwargs": "rows are always prepared; pass rows that already hold input_ids to skip it",
    "SFTConfig.eval_packing": "evaluation rows are never packed",
    "SFTTrainer.compute_loss_func": "the loss is SFT's own (stages.losses.sft_loss)",
    "RewardTrainer.compute_metrics": _NO_METRICS,
    "RewardTrainer.preprocess_logits_for_metrics": _NO_METRICS,
    "DPOConfig.precompute_ref_batch_size": "the reference pass of precompute_ref_log_probs uses "
                                           "per_device_eval_batch_size",
    "DPOConfig.ld_alpha": "LD-DPO's length weighting is not built",
    "DPOConfig.f_divergence_type": "f-DPO is not built (loss_type variants: stages.losses.DPO_LOSSES)",
    "DPOConfig.f_alpha_divergence_coef": "f-DPO is not built (loss_type variants: stages.losses.DPO_LOSSES)",
    "DPOConfig.use_weighting": "WPO weighting is not built; a 'weight' column scales each pair's loss instead",
    "DPOConfig.discopop_tau": "the DiscoPOP loss is not built (loss_type variants: stages.losses.DPO_LOSSES)",
    "DPOTrainer.compute_metrics": _NO_METRICS,
    "KTOConfig.loss_type": "KTO's loss is 'kto' only; apo_zero_unpaired is not built",
    "KTOConfig.precompute_ref_log_probs": "KTO runs the reference every step (DPOConfig has precompute_ref_log_probs)",
    "KTOConfig.precompute_ref_batch_size": "KTO runs the reference every step",
    "KTOTrainer.compute_metrics": _NO_METRICS,
    "OnlineDPOConfig.beta": "a list of β values, one per epoch, is not built; give one float",
    "OnlineDPOConfig.reward_model_path": "give the reward model's folder in reward_funcs",
    "OnlineDPOConfig.missing_eos_penalty": "not built for online DPO (PPOConfig has missing_eos_penalty)",
    "OnlineDPOTrainer.eval_dataset": "online DPO has no offline evaluation loss; evaluate the saved model",
    "OnlineDPOTrainer.compute_metrics": _NO_METRICS,
    "OnlineDPOTrainer.preprocess_logits_for_metrics": _NO_METRICS,
    "GRPOConfig.cast_lm_head_to_fp32": "not a switch here (log-probs come from the chunked lm-head kernel)",
    "GRPOConfig.num_generations_eval": "GRPO has no evaluation loop here",
    "GRPOConfig.generation_batch_size": "one generation per optimizer step (all its micro-batches), reused "
                                        "num_iterations times",
    "GRPOConfig.steps_per_generation": "one generation per optimizer step (all its micro-batches), reused "
                                       "num_iterations times",
    "GRPOConfig.chat_template_kwargs": "prompts are rendered with the chat template's defaults",
    "GRPOConfig.delta": _GRPO_LOSS, "GRPOConfig.sapo_temperature_neg": _GRPO_LOSS,
    "GRPOConfig.sapo_temperature_pos": _GRPO_LOSS, "GRPOConfig.vespo_k_pos": _GRPO_LOSS,
    "GRPOConfig.vespo_lambda_pos": _GRPO_LOSS, "GRPOConfig.vespo_k_neg": _GRPO_LOSS,
    "GRPOConfig.vespo_lambda_neg": _GRPO_LOSS, "GRPOConfig.off_policy_mask_threshold": _GRPO_LOSS,
    "GRPOConfig.importance_sampling_level": "importance ratios are per token (TRL's 'token'); GSPO's sequence level "
                                            "is not built",
    "GRPOConfig.multi_objective_aggregation": "rewards are summed with reward_weights, then normalised (TRL's "
                                              "default, sum_then_normalize)",
    "GRPOConfig.top_entropy_quantile": _ENTROPY, "GRPOConfig.entropy_coef": _ENTROPY,
    "GRPOConfig.use_adaptive_entropy": _ENTROPY, "GRPOConfig.entropy_coef_min": _ENTROPY,
    "GRPOConfig.entropy_coef_max": _ENTROPY, "GRPOConfig.entropy_coef_delta": _ENTROPY,
    "GRPOConfig.entropy_target": _ENTROPY,
    "GRPOConfig.max_tool_calling_iterations": "tool calling is not built",
    "GRPOConfig.vllm_importance_sampling_correction": _IS, "GRPOConfig.vllm_importance_sampling_mode": _IS,
    "GRPOConfig.vllm_importance_sampling_clip_max": _IS, "GRPOConfig.vllm_importance_sampling_clip_min": _IS,
    "GRPOConfig.use_bias_correction_kl": "the k3 KL term is not reweighted by the importance ratio",
    "GRPOConfig.log_completions": _LOG, "GRPOConfig.log_multimodal": _LOG,
    "GRPOConfig.num_completions_to_print": _LOG, "GRPOConfig.log_unique_prompts": _LOG,
    "GRPOConfig.log_completions_hub_repo": _LOG,
    "GRPOConfig.use_transformers_continuous_batching": "the generation backends are hf (batched generate) and vllm",
    "GRPOConfig.transformers_continuous_batching_config": "the generation backends are hf (batched generate) and "
                                                          "vllm",
    "GRPOConfig.use_transformers_paged": "the generation backends are hf (batched generate) and vllm",
    "GRPOTrainer.eval_dataset": "GRPO has no evaluation loop here; evaluate the saved model",
    "GRPOTrainer.tools": "tool calling is not built",
    "GRPOTrainer.rollout_func": "rollouts are the trainer's own (stages.generation)",
    "GRPOTrainer.environment_factory": "environments (multi-turn agents) are not built",
    "RLOOConfig.generation_batch_size": "one generation per optimizer step (all its micro-batches), reused "
                                        "num_iterations times",
    "RLOOConfig.steps_per_generation": "one generation per optimizer step (all its micro-batches), reused "
                                       "num_iterations times",
    "RLOOConfig.use_transformers_continuous_batching": "the generation backends are hf (batched generate) and vllm",
    "RLOOConfig.transformers_continuous_batching_config": "the generation backends are hf (batched generate) and "
                                                          "vllm",
    "RLOOConfig.use_transformers_paged": "the generation backends are hf (batched generate) and vllm",
    "DistillationConfig.max_tool_calling_iterations": "tool calling is not built",
    "DistillationTrainer.eval_dataset": "distillation has no evaluation loop here; evaluate the saved model",
    "DistillationTrainer.tools": "tool calling is not built",
}


def unsupported_reason(owner: str, name: str) -> str | None:
    """Why TRL's `owner.name` (e.g. "GRPOConfig", "use_vllm") is not supported, or None when it is not listed."""
    return UNSUPPORTED.get(f"{owner}.{name}", UNSUPPORTED.get(name))


def unsupported_message(qualified: str, name: str) -> str:
    """The error for a TRL setting we do not support: names it as TRL's, says why and what to do."""
    owner = qualified.rsplit(".", 1)[0]
    reason = unsupported_reason(owner, name) or "not listed"
    return (f"{qualified}: TRL {TRL_VERSION}'s `{name}` is not supported by stages.trainers yet ({reason}); "
            f"remove it")


def unsupported_trl_fields(config, given: Mapping[str, Any] | Iterable[str]) -> list[tuple[str, str]]:
    """[(key, message)] for every key of `given` that names a TRL setting of `config` we do not support.

    config: our config class (its dataclass fields tell which keys are ours) or its name.
    given: the keys set by the user (kwargs, a params.yaml section) with their values, or the keys alone.
    A listed name that is a field of ours inherited from `transformers.TrainingArguments` (e.g.
    use_liger_kernel) is refused only when its value differs from the default; one declared by our own
    config is ours and never refused; one we lack is refused whenever given.
    """
    name = config if isinstance(config, str) else config.__name__
    fields = {} if isinstance(config, str) else {f.name: f for f in dataclasses.fields(config)}
    values = dict(given) if isinstance(given, Mapping) else dict.fromkeys(given, _UNSET)
    problems = []
    for key, value in values.items():
        if unsupported_reason(name, key) is None:
            continue
        field = fields.get(key)
        if field is not None and (not inherited_from_transformers(config, key) or value is _UNSET
                                  or value == _default(field)):
            continue
        problems.append((key, unsupported_message(f"{name}.{key}", key)))
    return problems


_UNSET = object()


def inherited_from_transformers(config: type, field: str) -> bool:
    """Whether `config`'s field is declared by a transformers class (TrainingArguments), not by our own."""
    for klass in config.__mro__:
        if field in klass.__dict__.get("__annotations__", {}):
            return klass.__module__.startswith("transformers.")
    return False


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _UNSET
