"""The "continuous_batching" backend: transformers' continuous batching engine (`model.generate_batch`, a paged KV
cache; TRL's `use_transformers_continuous_batching`) on a loaded model, on CPU or GPU.

Every completion is its own request (a prompt's ``n`` completions are ``n`` requests of the same tokens); the engine
schedules them over a paged cache, so prompts are never padded. Decoding is greedy or samples with temperature,
top-k and top-p, the processors the engine implements for a batch of requests; the other sampling settings
(repetition_penalty, min_p, beam search, generation_kwargs, cache_implementation) are refused with the reason
rather than run by processors the engine does not support. Sampling draws from the engine's own generator, seeded
with the call's seed: a call is reproducible, but a prompt's completions depend on the whole call (the "hf" and
"decoder" backends seed each prompt on its own). Sampled completions come with their tokens' log-probs.

`config`: keyword arguments of `transformers.generation.ContinuousBatchingConfig`. Without `num_blocks` or
`max_memory_percent` the cache is sized to this call's requests (blocks of `page_size` tokens for the longest prompt
plus max_new_tokens, per request), instead of a share of the free (GPU, else system) memory.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from stages.generation.common import Generations, SamplingParams, build_generations, eos_token_ids, trim_at_eos

DEFAULT_PAGE_SIZE = 256  # ContinuousBatchingConfig's


def why_not(s: SamplingParams) -> str | None:
    """Why the continuous batching engine cannot decode with these settings (None when it can)."""
    if s.num_beams > 1:
        return f"beam search (num_beams = {s.num_beams})"
    if s.repetition_penalty != 1.0:
        return f"repetition_penalty = {s.repetition_penalty} (the engine does not support its processor)"
    if s.min_p:
        return f"min_p = {s.min_p} (the engine applies temperature, top_k and top_p only)"
    if s.generation_kwargs:
        return f"generation_kwargs {sorted(s.generation_kwargs)} (generate's own arguments)"
    if s.cache_implementation is not None:
        return f"cache_implementation = {s.cache_implementation!r} (the engine keeps its own paged cache)"
    return None


def generate(model, tokenizer, prompts: list, sampling: SamplingParams, *, batch_size: int = 64,
             progress: bool = False, config: dict | None = None, tools: list | None = None) -> Generations:
    """Completions of ``prompts`` through ``model.generate_batch`` (see :func:`stages.generation.generate`).

    ``batch_size`` is not used: the engine batches its requests itself. The model is in eval mode for the call and
    its previous mode is restored; no gradients. A request the engine fails or loses is an error (RuntimeError).
    """
    from transformers import GenerationConfig

    from stages.generation.hf import prompt_token_ids

    reason = why_not(sampling)
    if reason:
        raise ValueError(f"generation backend = 'continuous_batching' cannot decode with {reason}; unset it, or use "
                         "generation backend hf")
    eos = eos_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rendered, prompt_ids = prompt_token_ids(tokenizer, prompts, tools)
    n = sampling.n
    requests = [ids for ids in prompt_ids for _ in range(n)]
    if not requests:
        return build_generations(tokenizer, prompts, rendered, prompt_ids, [[] for _ in prompts], eos,
                                 seed=sampling.seed, backend="continuous_batching")
    gen = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample, eos_token_id=eos,
                           pad_token_id=pad_id, num_return_sequences=1)
    if sampling.do_sample:
        gen.update(temperature=float(sampling.temperature), top_p=float(sampling.top_p), top_k=sampling.top_k)
    cb = engine_config(config, requests, sampling)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), engine_attention(model):
            results = model.generate_batch(requests, generation_config=gen, continuous_batching_config=cb,
                                           progress_bar=progress)
    finally:
        model.train(was_training)
    outputs = list(results.values())
    failed = [r.request_id for r in outputs if r.error is not None]
    if len(outputs) != len(requests) or failed:
        raise RuntimeError(f"transformers' continuous batching returned {len(outputs)} of {len(requests)} requests"
                           f"{f', {len(failed)} failed (first: {failed[0]})' if failed else ''}; its log says why")
    per_prompt: list[list[list[int]]] = []
    per_prompt_logps: list[list[list[float]]] | None = [] if sampling.do_sample else None
    for p in range(len(prompts)):
        rows = outputs[p * n:(p + 1) * n]
        per_prompt.append([trim_at_eos(list(r.generated_tokens), eos) for r in rows])
        if per_prompt_logps is not None:
            per_prompt_logps.append([list(r.logprobs)[:len(c)] for r, c in zip(rows, per_prompt[-1], strict=True)])
    return build_generations(tokenizer, prompts, rendered, prompt_ids, per_prompt, eos, seed=sampling.seed,
                             backend="continuous_batching", logprobs=per_prompt_logps)


@contextlib.contextmanager
def engine_attention(model) -> Iterator[None]:
    """The engine runs sdpa, eager or flash attention; a trainer's CPU-autocast variant of sdpa
    (`stages.precision.CPU_FP32_SDPA`) is plain sdpa for the call, and is restored after it."""
    from stages.precision import CPU_FP32_SDPA

    if getattr(getattr(model, "config", None), "_attn_implementation", None) != CPU_FP32_SDPA:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(CPU_FP32_SDPA)


def engine_config(config: dict | None, requests: list[list[int]], sampling: SamplingParams):
    """The ContinuousBatchingConfig of a call: the given keyword arguments, the call's seed, log-probs when
    sampling, unsupported processors refused (not dropped), and a cache sized to the requests unless sized."""
    from transformers.generation import ContinuousBatchingConfig

    kwargs = dict(config or {})
    kwargs.setdefault("seed", sampling.seed)
    kwargs.setdefault("return_logprobs", sampling.do_sample)
    kwargs["drop_unsupported_processors"] = False  # why_not has refused them; never drop one silently
    if "num_blocks" not in kwargs and kwargs.get("max_memory_percent") is None:
        page = kwargs.get("page_size", DEFAULT_PAGE_SIZE)
        longest = max(len(r) for r in requests) + sampling.max_new_tokens
        kwargs["num_blocks"] = len(requests) * math.ceil(longest / page)
    try:
        return ContinuousBatchingConfig(**kwargs)
    except TypeError as e:
        raise ValueError(f"transformers_continuous_batching_config = {config}: {e} (the keys are "
                         "transformers.generation.ContinuousBatchingConfig's)") from None
