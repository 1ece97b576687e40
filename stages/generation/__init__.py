"""Generating completions for a list of prompts: one entry point over several backends.

    from stages.generation import SamplingParams, generate
    gens = generate(model, tokenizer, prompts, SamplingParams(n=4, do_sample=True, max_new_tokens=64, seed=1))
    gens.completions[k], gens.prompt_index[k], gens.backend   # completion k, its prompt, what produced it

Backends (``BACKENDS``), the first three in this process on a loaded model (``stages.generation.hf``):
- ``"auto"`` (default): the CPU decoder (``stages.generation.decoder``) where ``decoder.why_not`` allows it,
  HF ``model.generate`` otherwise;
- ``"hf"``: always HF ``model.generate``;
- ``"decoder"``: always the CPU decoder; a model it cannot run fails with ``why_not``'s reason;
- ``"vllm"``: a client of a vLLM OpenAI-compatible server started in its own environment
  (``stages.generation.vllm``; ``serve_command`` builds its command line);
- ``"continuous_batching"``: transformers' continuous batching engine (``model.generate_batch``, a paged KV
  cache) on the loaded model (``stages.generation.continuous``; ``config=`` its ContinuousBatchingConfig arguments).

All render prompts with the tokenizer's chat template, return completions in prompt-major order and apply
the same EOS trimming and reasoning-block policy (``stages.completion_text.parse_completions``).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from stages.generation import continuous, hf, vllm
from stages.generation.common import Generations, SamplingParams

__all__ = ["BACKENDS", "Generations", "SamplingParams", "generate"]

BACKENDS: dict[str, Callable[..., Generations]] = {
    **{name: partial(hf.generate, backend=name) for name in hf.CHOICES}, "vllm": vllm.generate,
    "continuous_batching": continuous.generate}


def generate(model, tokenizer, prompts: list, sampling: SamplingParams, *, backend: str | None = None,
             batch_size: int | None = None, progress: bool = False, tools: list | None = None,
             **backend_options) -> Generations:
    """``sampling.n`` completions for each of ``prompts`` (strings or chat message lists).

    Args:
        model: "auto", "hf", "decoder": a loaded causal LM (or a model folder); "vllm": the model path
            (or served name) of the running server.
        tokenizer: the model's tokenizer; it renders prompts (chat template + generation
            prompt) and decodes completions.
        prompts: P prompts.
        sampling: decoding parameters (greedy, sampling or beam search; ``n`` per prompt), the backend and
            the prompts per call (``stages.sampling.SamplingParams``).
        backend: a ``BACKENDS`` key; None: ``sampling.backend``.
        batch_size: prompts per ``generate`` call (in process), requests in flight ("vllm"); None:
            ``sampling.batch_size``.
        progress: log rate-limited progress lines with an ETA (``stages.basics``).
        tools: P values of the prompts' rows' ``tools`` column (None where a row has none), shown by the
            chat template with each conversational prompt (``stages.data.tool_calls``).
        **backend_options: passed to the backend, e.g. ``base_url=`` for "vllm".

    Returns:
        Generations with P*n completions, all n of prompt 0 first, then prompt 1, ...
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a stages.generation.SamplingParams; got {type(sampling).__name__} "
                         "(build one: SamplingParams(max_new_tokens=..., n=..., do_sample=...))")
    if tools is not None and len(tools) != len(prompts):
        raise ValueError(f"tools has {len(tools)} entries for {len(prompts)} prompts; give one per prompt (None "
                         "where a prompt has no tools)")
    backend = sampling.backend if backend is None else backend
    batch_size = sampling.batch_size if batch_size is None else batch_size
    if backend not in BACKENDS:
        raise ValueError(f"generation backend = {backend!r}: unknown; supported: {', '.join(BACKENDS)}")
    return BACKENDS[backend](model, tokenizer, list(prompts), sampling, batch_size=batch_size, progress=progress,
                             tools=tools, **backend_options)

