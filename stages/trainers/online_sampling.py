"""Sampling from the policy during training, shared by online DPO, GRPO and PPO (and `score`'s settings).

`GenerationParams` is the sampling section (`policy.<method>.generation`, `score.generation`)
and the `generation` field of the online trainers' configs; `sample_online` turns it into one
`stages.generation.sample_policy` call; `sampling_seed` is the one seed formula every online
trainer uses, so two trainers given the same seed and draw number sample alike:

    seed(draw) = run seed + 100_003 · draw + process index

`draw` counts the trainer's generation calls (one per micro-batch for GRPO and online DPO, one
per rollout for PPO); the process index gives every data-parallel rank its own samples.
Torch and the generation backends are imported only when sampling.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from stages.fields import non_negative, param, positive

SEED_STRIDE = 100_003  # a prime: draws of one run never share a seed across ranks (< 100k processes)


@dataclass
class GenerationParams:
    """How completions are sampled (`stages.generation`): backend and decoding settings."""

    backend: Literal["hf", "vllm"] = param("hf", help="hf: batched transformers generate; vllm: a vLLM server "
                                           "(OpenAI API) started in its own environment, see README")
    max_new_tokens: int = positive(64, "generation budget per completion (tokens)")
    temperature: float = positive(1.0, "sampling temperature")
    top_p: float = param(1.0, help="nucleus sampling mass", check=lambda v: 0 < v <= 1, rule="must be in (0, 1]")
    top_k: int = non_negative(0, "sample from the k most likely tokens only (0: off)")
    batch_size: int = positive(64, "prompts per generate call")
    vllm_url: str = param("http://127.0.0.1:8000/v1", help="base URL of the vLLM server (backend: vllm)")
    vllm_model: str | None = param(None, help="model name the vLLM server serves (null: the model's path)")


GENERATION_BACKENDS = typing.get_args(typing.get_type_hints(GenerationParams)["backend"])


def sampling_seed(seed: int, draw: int, process_index: int) -> int:
    """The seed of generation call number `draw` on process `process_index` (see the module doc)."""
    return seed + SEED_STRIDE * draw + process_index


def backend_options(g: GenerationParams, model_path: str | None) -> dict[str, str]:
    """Options of the backend: the vLLM server's URL and served model name (default: `model_path`)."""
    if g.backend != "vllm":
        return {}
    return {"base_url": g.vllm_url, "model": g.vllm_model or model_path}


def sample_online(model, tokenizer, prompts: list, g: GenerationParams, *, n: int, seed: int):
    """`n` sampled completions per prompt from `model` (unwrapped from DDP) with settings `g`: `Generations`.

    With backend vllm the server samples from its own weights, which training does not update:
    the samples are off-policy once the policy has moved.
    """
    from stages.generation import SamplingParams, sample_policy

    sampling = SamplingParams(max_new_tokens=g.max_new_tokens, n=n, do_sample=True, temperature=g.temperature,
                              top_p=g.top_p, top_k=g.top_k, seed=seed)
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    return sample_policy(model, tokenizer, prompts, sampling, backend=g.backend, batch_size=g.batch_size,
                         options=backend_options(g, path))
