"""Sampling from the policy during training, shared by online DPO, GRPO and PPO (and `score`'s settings).

`GenerationParams` is the sampling section (`policy.<method>.generation`, `score.generation`)
and the `generation` field of the online trainers' configs; `sample_online` turns it into one
`stages.generation.generate` call. Every online trainer (and `score`) seeds its sampling the same way:

    call seed   = stable_seed(run seed, draw)                      (stages.basics)
    prompt seed = stable_hash(call seed, the prompt's token ids)   (stages.generation.common.prompt_seed)

`draw` is the optimizer step (`state.global_step`: global, the same on every rank, restored on
resume); `score` samples once, draw 0. Each prompt's n completions come from its own prompt
seed, so a prompt gets the same token ids whatever its batch, position in it, rank, shard or
resume. Two equal prompts in one step get equal completions. Torch and the generation backends
are imported only when sampling.
"""
from __future__ import annotations

from typing import Any

from stages.trainers.generation_params import GENERATION_BACKENDS, GenerationParams, backend_options  # noqa: F401 (re-exported)


def sample_online(model, tokenizer, prompts: list, g: GenerationParams, *, n: int, seed: int, precision: str = "no",
                  **decoding: Any):
    """`n` sampled completions per prompt from `model` (unwrapped from DDP) with settings `g`: `Generations`.

    decoding: further `stages.generation.SamplingParams` fields (min_p, repetition_penalty, cache_implementation).
    precision: the autocast `model`'s forward already runs under (the trainer's, "no", "bf16", "fp16"):
    the whole call becomes one autocast region, so the weights are cast once, not at every decode step
    (`stages.precision.cached_casts`; the same casts, so the same samples).

    With backend vllm the server named by the options (`backend_options`) samples from its own copy of the weights,
    which training does not update: the samples are off-policy once the policy has moved; their `logprobs` (the
    server's log-probs of what it sampled) are what GRPO's truncated importance sampling corrects with.
    """
    from stages.generation import SamplingParams, generate
    from stages.precision import cached_casts

    sampling = SamplingParams(max_new_tokens=g.max_new_tokens, n=n, do_sample=True, temperature=g.temperature,
                              top_p=g.top_p, top_k=g.top_k, seed=seed, **decoding)
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    options: dict[str, Any] = backend_options(g, path)
    source = options.pop("model") if g.backend == "vllm" else model
    with cached_casts(model, precision if g.backend != "vllm" else "no"):
        return generate(source, tokenizer, prompts, sampling, backend=g.backend, batch_size=g.batch_size, **options)
