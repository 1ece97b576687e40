"""Sampling settings of the online methods and `score`: `GenerationParams` (the `generation` sections
and the online trainers' `generation` field), the backends and backend options.
No torch or generation backend is imported here, so params validation stays light; the sampling
itself is `stages.trainers.online_generation`.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from stages.fields import non_negative, param, positive

MIN_P_HELP = "drop tokens less likely than min_p times the most likely one (null: off)"
REPETITION_PENALTY_HELP = ("penalise tokens already in the prompt or completion: positive logits divided by it, "
                           "negative ones multiplied (1.0: off)")
GENERATION_KWARGS_HELP = ("further arguments of HF generate (backend hf, e.g. no_repeat_ngram_size) or fields of the "
                          "vLLM request (backend vllm); the sampling settings above are their own keys")
CACHE_IMPLEMENTATION_HELP = "HF generate's KV cache: static, offloaded, ... (backend hf; null: the model's default)"


@dataclass
class GenerationParams:
    """How completions are sampled (`stages.generation`): backend and decoding settings."""

    backend: Literal["auto", "hf", "decoder", "vllm", "continuous_batching"] = param(
        "auto", help="auto: the CPU decoder where stages.generation.decoder.why_not allows it, transformers "
        "generate otherwise; hf: always transformers generate; decoder: always the CPU decoder (Llama, Mistral, "
        "Qwen2/3 on CPU; fails with the reason otherwise); vllm: a vLLM server (OpenAI API) in its own "
        "environment; continuous_batching: transformers' continuous batching engine (generate_batch)")
    max_new_tokens: int = positive(64, "generation budget per completion (tokens)")
    temperature: float = positive(1.0, "sampling temperature")
    top_p: float = param(1.0, help="nucleus sampling mass", check=lambda v: 0 < v <= 1, rule="must be in (0, 1]")
    top_k: int = non_negative(0, "sample from the k most likely tokens only (0: off)")
    min_p: float | None = param(None, help=MIN_P_HELP, check=lambda v: 0 <= v < 1, rule="must be in [0, 1) or null")
    repetition_penalty: float = positive(1.0, REPETITION_PENALTY_HELP)
    generation_kwargs: dict | None = param(None, help=GENERATION_KWARGS_HELP)
    cache_implementation: str | None = param(None, help=CACHE_IMPLEMENTATION_HELP)
    batch_size: int = positive(64, "prompts per generate call")
    vllm_url: str = param("http://127.0.0.1:8000/v1", help="base URL of the vLLM server (backend: vllm)")
    vllm_model: str | None = param(None, help="model name the vLLM server serves (null: the model's path)")
    continuous_batching_config: dict | None = param(None, help="backend continuous_batching: keyword arguments of "
                                                    "transformers' ContinuousBatchingConfig (null: a cache sized to "
                                                    "each call)")


GENERATION_BACKENDS = typing.get_args(typing.get_type_hints(GenerationParams)["backend"])


def backend_options(g: GenerationParams, model_path: str | None) -> dict[str, Any]:
    """Options of the backend: the vLLM server's URL and served model name (default: `model_path`); the engine's
    settings of continuous_batching."""
    if g.backend == "continuous_batching":
        return {"config": g.continuous_batching_config}
    if g.backend != "vllm":
        return {}
    return {"base_url": g.vllm_url, "model": g.vllm_model or model_path}
