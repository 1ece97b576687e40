"""Fields and rules several method configs share (torch-free: the configs are also read by params validation).

`stages.trainers.arguments` explains why a config module may import only light modules like this one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from stages.fields import deprecated, param, positive

BETA_HELP = ("KL strength to the reference (TRL's default: 0.1; 0.3 chosen on the built-in task's dev split, "
             "docs/methods.md)")


def beta_field(*, per_epoch: bool = False) -> Any:
    """`beta` of DPO, KTO and online DPO: one default (0.3, the built-in task's dev choice; TRL: 0.1). With
    `per_epoch` (online DPO, as TRL's), a list of values, one per epoch, is accepted too (`beta_for_epoch`)."""
    if not per_epoch:
        return positive(0.3, BETA_HELP)
    return param(0.3, help=BETA_HELP + "; a list gives one β per epoch, its last for the epochs after it",
                 check=lambda v: v != [] and all(b > 0 for b in (v if isinstance(v, list) else [v])),
                 rule="must be > 0, or a non-empty list of values > 0")


def beta_for_epoch(beta: float | list[float], epoch: float) -> float:
    """β for the (0-based, possibly fractional) `epoch`: `beta` itself, or its entry for that epoch, the last
    entry once the list runs out."""
    if not isinstance(beta, list):
        return beta
    return beta[min(int(epoch), len(beta) - 1)]


def loss_type_field() -> Any:
    return param("sigmoid", help="DPO variant (stages.losses.DPO_LOSSES), sft, a module:function objective, or a "
                 "list of them combined with loss_weights")


def chunked_field() -> Any:
    return param(True, help="log-probs from the final hidden states in chunks, without the full logits, where the "
                 "model allows")


def num_proc_field() -> Any:
    return param(None, help="processes that tokenise the dataset (null: this one)", check=lambda v: v >= 1,
                 rule="must be >= 1 or null")


def objective_names(loss_type: str | list[str]) -> list[str]:
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


def objectives_problems(config) -> list[tuple[str, str]]:
    """The `loss_type` / `loss_weights` rules of a DPO or online DPO config; a real (not light) config also
    imports a dotted-path objective to check it (the stage does it before any model)."""
    from stages.trainers.arguments import is_light

    problems = check_objectives(objective_names(config.loss_type), config.loss_weights)
    if not is_light(config):
        from stages.losses import objective_problems

        problems += objective_problems(config.loss_type)
    return problems


def check_objectives(names: list[str], weights: list[float] | None) -> list[tuple[str, str]]:
    """The rules of a `loss_type` list and its `loss_weights`, shared by DPO and online DPO."""
    problems = []
    if not names:
        problems.append(("loss_type", "= []: name at least one loss"))
    if weights is not None:
        if len(weights) != len(names):
            problems.append(("loss_weights", f"= {weights}: {len(weights)} weight(s) for {len(names)} loss "
                             "type(s); give one per entry or null for all 1.0"))
        if any(not (math.isfinite(w) and w >= 0) for w in weights):
            problems.append(("loss_weights", f"= {weights}: each must be a finite number >= 0"))
    return problems


def f_divergence_problems(divergence: str, names: list[str], *, light: bool) -> list[tuple[str, str]]:
    """f-DPO scores the margin of some DPO variants only (`stages.losses.F_DIVERGENCE_LOSSES`; a light config,
    torch-free, leaves the check to the real one the stage builds)."""
    if divergence == "reverse_kl" or light:
        return []
    from stages.losses.preference import F_DIVERGENCE_LOSSES

    others = [n for n in names if n not in F_DIVERGENCE_LOSSES]
    if not others:
        return []
    return [("f_divergence_type", f"= {divergence!r}: applies to loss_type {', '.join(F_DIVERGENCE_LOSSES)} only; "
             f"loss_type also names {others}: use reverse_kl with those, or drop them")]


# helps of the sampling settings the online configs (SamplingFields) and score's section (harness.config) share
MIN_P_HELP = "drop tokens less likely than min_p times the most likely one (null: off)"
REPETITION_PENALTY_HELP = ("penalise tokens already in the prompt or completion: positive logits divided by it, "
                           "negative ones multiplied (1.0: off)")
GENERATION_KWARGS_HELP = ("further arguments of HF generate (backend hf, e.g. no_repeat_ngram_size) or fields of the "
                          "vLLM request (backend vllm); the sampling settings above are their own keys")
CACHE_IMPLEMENTATION_HELP = "HF generate's KV cache: static, offloaded, ... (backend hf; null: the model's default)"

# The sampling settings of the online configs, flat as in TRL (`max_completion_length` or `max_new_tokens` is the
# config's own field, named as TRL names it there). The old nested `generation` section maps onto them.
SAMPLING_RENAMES = {"backend": "generation_backend", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "batch_size": "generation_prompts_per_call", "vllm_url": "vllm_server_base_url",
                    "vllm_model": "vllm_model", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "generation_kwargs": "generation_kwargs", "cache_implementation": "cache_implementation"}


@dataclass
class SamplingFields:
    """How the online trainers sample (`stages.generation`), flat as in TRL; `sampling` gives them, with the
    completions per prompt, as the one record the backend takes (`stages.sampling.SamplingParams`)."""

    MAX_TOKENS: ClassVar[str] = "max_completion_length"  # the config's field holding the generation budget
    # completions per prompt: the config's field holding them (GRPO's num_generations), or their fixed number
    SAMPLES: ClassVar[str | int] = 1

    generation_backend: Literal["auto", "hf", "decoder", "vllm", "continuous_batching"] = param(
        "auto", help="auto: the CPU decoder where it can run, else HF generate; hf: HF generate; decoder: the CPU "
        "decoder or an error saying why not; vllm: a vLLM server (OpenAI API) in its own environment; "
        "continuous_batching: transformers' continuous batching engine (generate_batch, a paged KV cache)")
    temperature: float = positive(1.0, "sampling temperature")
    top_p: float = param(1.0, help="nucleus sampling mass", check=lambda v: 0 < v <= 1, rule="must be in (0, 1]")
    top_k: int = param(0, help="sample from the k most likely tokens only (0: off)", check=lambda v: v >= 0,
                       rule="must be >= 0")
    min_p: float | None = param(None, help=MIN_P_HELP, check=lambda v: 0 <= v < 1, rule="must be in [0, 1) or null")
    repetition_penalty: float = positive(1.0, REPETITION_PENALTY_HELP)
    generation_kwargs: dict | None = param(None, help=GENERATION_KWARGS_HELP)
    cache_implementation: str | None = param(None, help=CACHE_IMPLEMENTATION_HELP)
    generation_prompts_per_call: int = positive(64, "prompts per generate call")
    vllm_server_base_url: str = param("http://127.0.0.1:8000/v1", help="base URL of the vLLM server "
                                      "(generation_backend: vllm)")
    vllm_model: str | None = param(None, help="model name the vLLM server serves (null: the model's path)")

    @property
    def sampling(self):
        """The sampling record of this config (`stages.sampling.SamplingParams`): n completions per prompt
        (SAMPLES), sampled; the trainer sets each call's seed."""
        from stages.sampling import SamplingParams

        return SamplingParams(**self.sampling_settings())

    def sampling_settings(self) -> dict[str, Any]:
        """`sampling`'s fields from this config's; a config whose TRL fields also steer sampling (use_vllm,
        generation_kwargs overrides) updates them."""
        n = getattr(self, self.SAMPLES) if isinstance(self.SAMPLES, str) else self.SAMPLES
        return dict(backend=self.generation_backend, max_new_tokens=getattr(self, self.MAX_TOKENS), n=n,
                    do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty,
                    generation_kwargs=self.generation_kwargs, cache_implementation=self.cache_implementation,
                    batch_size=self.generation_prompts_per_call, vllm_url=self.vllm_server_base_url,
                    vllm_model=self.vllm_model)


@dataclass
class ContinuousBatchingFields:
    """TRL's switches for transformers' continuous batching (GRPO, RLOO): the generation backend continuous_batching
    (`stages.generation.continuous`) with the engine's settings."""

    if TYPE_CHECKING:  # SamplingFields'
        generation_backend: str

    use_transformers_continuous_batching: bool = param(
        False, help="sample with transformers' continuous batching engine (generate_batch, a paged KV cache; "
        "generation_backend continuous_batching): greedy or temperature / top_k / top_p sampling, seeded per call")
    transformers_continuous_batching_config: dict | None = param(
        None, help="use_transformers_continuous_batching: keyword arguments of transformers' ContinuousBatchingConfig "
        "(e.g. {page_size: 64, max_batch_tokens: 512}; null: a KV cache sized to each generation's requests)")
    use_transformers_paged: bool | None = deprecated("use_transformers_continuous_batching",
                                                     "TRL's deprecated name of use_transformers_continuous_batching")

    def continuous_batching_problems(self) -> list[tuple[str, str]]:
        on, backend = self.use_transformers_continuous_batching, self.generation_backend
        if on and backend not in ("auto", "continuous_batching"):
            return [("use_transformers_continuous_batching", f"= True but generation_backend = {backend!r}: it is "
                     "generation_backend continuous_batching; drop one of them")]
        if on and getattr(self, "use_vllm", False):
            return [("use_transformers_continuous_batching", "= True with use_vllm: pick one sampler")]
        if self.transformers_continuous_batching_config and not on and backend != "continuous_batching":
            return [("transformers_continuous_batching_config", "is set but nothing samples with continuous "
                     "batching; set use_transformers_continuous_batching: true, or remove it")]
        return []

    @property
    def sampling(self):
        g = super().sampling  # type: ignore[misc]
        if not self.use_transformers_continuous_batching and g.backend != "continuous_batching":
            return g
        return dataclasses.replace(g, backend="continuous_batching",
                                   continuous_batching_config=self.transformers_continuous_batching_config)


def sampling_renames(max_tokens: str) -> dict[str, str]:
    """The deprecated `generation` section's keys -> the flat fields of a config whose budget is `max_tokens`."""
    return {**SAMPLING_RENAMES, "max_new_tokens": max_tokens}


def tis_cap_field() -> Any:
    return param(2.0, help="off-policy correction: each token's policy-gradient term is weighted min(pi/mu, cap), "
                 "pi the policy at sampling time, mu the sampler's own log-prob (truncated importance sampling; 2.0 "
                 "as in the literature); null: no correction", check=lambda v: v >= 1,
                 rule="must be >= 1 (a cap below 1 would down-weight on-policy tokens, whose ratio is 1), or null to "
                 "turn the correction off")


def tis_warn_field() -> Any:
    return positive(0.1, "warn when the logged tis/mean_ratio departs from 1 by more than this: on policy it is 1 to "
                    "float rounding, and E_mu[pi/mu] = 1 for any sampler covering the policy's support, so a larger "
                    "departure means the sampler truncates the distribution (top-p/top-k, raw instead of processed "
                    "log-probs) or the ratios are so heavy-tailed that the capped gradient is biased")


# ---- how a trainer loads the model and the tokenizer (stages.trainers.inputs applies them)

@dataclass
class GenerationBatchFields:
    """How many micro-batches one generation feeds (GRPO and RLOO; TRL's steps_per_generation and
    generation_batch_size); `stages.trainers.grpo_trainer` samples, buffers and reuses the rollouts."""

    if TYPE_CHECKING:  # TrainingArguments'
        per_device_train_batch_size: int
        gradient_accumulation_steps: int

    steps_per_generation: int | None = param(None, help="micro-batches one generation feeds (null: "
                                             "gradient_accumulation_steps, one generation per optimizer step)",
                                             check=lambda v: v >= 1, rule="must be >= 1 or null")
    generation_batch_size: int | None = param(None, help="completions per generation over all processes (null: "
                                              "per_device_train_batch_size x processes x steps_per_generation); "
                                              "set this or steps_per_generation", check=lambda v: v >= 1,
                                              rule="must be >= 1 or null")

    def generation_batch_problems(self) -> list[tuple[str, str]]:
        batch, processes = self.per_device_train_batch_size, _processes(self)
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            return [("generation_batch_size", f"= {self.generation_batch_size} and steps_per_generation = "
                     f"{self.steps_per_generation}: set one (each follows from the other)")]
        if self.generation_batch_size is not None and self.generation_batch_size % (batch * processes):
            return [("generation_batch_size", f"= {self.generation_batch_size}: must be a multiple of "
                     f"per_device_train_batch_size x processes = {batch * processes} (one generation feeds whole "
                     "micro-batches)")]
        return []

    @property
    def resolved_steps_per_generation(self) -> int:
        """Micro-batches per generation, as TRL derives it: steps_per_generation, else generation_batch_size /
        (per_device_train_batch_size x processes), else gradient_accumulation_steps."""
        if self.steps_per_generation is not None:
            return self.steps_per_generation
        if self.generation_batch_size is not None:
            return self.generation_batch_size // (self.per_device_train_batch_size * _processes(self))
        return self.gradient_accumulation_steps


def _processes(config) -> int:
    """Data-parallel processes of a real config (TrainingArguments.world_size); 1 for a light one (params)."""
    return getattr(config, "world_size", 1) or 1


@dataclass
class TokenizerFields:
    """TRL's tokenizer fields of SFT, reward and DPO (`stages.trainers.inputs.configure_tokenizer`)."""

    chat_template_path: str | None = param(
        None, help="a Jinja chat template file (.jinja / .j2), or a tokenizer folder whose template to use, "
        "set on the tokenizer before tokenising")
    eos_token: str | None = param(None, help="end-of-sequence token (a token of the vocabulary) set on the "
                                  "tokenizer and the model's generation config (null: the tokenizer's)")
    pad_token: str | None = param(None, help="padding token (a token of the vocabulary; null: the tokenizer's, "
                                  "else its EOS)")


def _pad_multiple(value: Any) -> bool:
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def pad_to_multiple_of_field() -> Any:
    return param(None, help="pad each batch's length up to a multiple of this (null: to its longest row; 'auto', "
                 "TRL's default, pads only on AWS Neuron, so here as null)", check=_pad_multiple,
                 rule="must be a positive integer, 'auto' or null")


def pad_multiple(value: int | str | None) -> int | None:
    """The multiple to pad to: 'auto' (TRL's setting for Neuron devices, which we do not target) is None."""
    return None if value in (None, "auto") else int(value)


def router_aux_loss_coef_field() -> Any:
    """TRL's `router_aux_loss_coef` (SFT, DPO, KTO, GRPO, RLOO): run-time meaning in `stages.trainers.model_options`."""
    return param(None, help="Mixture-of-Experts models: weight of the router's load-balancing loss added to the "
                 "training loss (null: the model config's router_aux_loss_coef; 0: off; a model without a router "
                 "refuses a value > 0)", check=lambda v: v >= 0, rule="must be >= 0 or null")


def precompute_ref_batch_size_field() -> Any:
    return param(None, help="rows per batch of the reference pass of precompute_ref_log_probs (null: "
                 "per_device_train_batch_size for the training rows, per_device_eval_batch_size for evaluation rows)",
                 check=lambda v: v >= 1, rule="must be >= 1 or null")


def activation_offloading_field() -> Any:
    return param(False, help="keep the activations saved for the backward pass in CPU memory instead of the GPU's "
                 "(stages.trainers.offloading)")


@dataclass
class RefSyncFields:
    """TR-DPO's reference syncing, TRL's names (DPO and KTO; `stages.trainers.ref_sync`)."""

    sync_ref_model: bool = param(False, help="move the reference towards the policy every ref_model_sync_steps "
                                 "steps (TR-DPO); needs a reference model: no PEFT, no precompute_ref_log_probs")
    ref_model_mixup_alpha: float = param(0.6, help="α of the sync: reference <- α·policy + (1 - α)·reference",
                                         check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]")
    ref_model_sync_steps: int = positive(512, "optimizer steps between two reference syncs")

    def ref_sync_problems(self) -> list[tuple[str, str]]:
        if self.sync_ref_model and getattr(self, "precompute_ref_log_probs", False):
            return [("sync_ref_model", "= true with precompute_ref_log_probs = true: precomputed reference log-probs "
                     "cannot follow a moving reference; set precompute_ref_log_probs: false")]
        return []


def truncation_mode_field() -> Any:
    return param("keep_start", help="which end of a row longer than max_length is kept: keep_start, TRL's only "
                 "non-deprecated mode (keep_end is deprecated in TRL 1.16 and not taken here)")


def disable_dropout_field() -> Any:
    return param(True, help="turn dropout off in the model and the reference model (TRL's default), so the "
                 "policy's and the reference's log-probs of the same text agree")
