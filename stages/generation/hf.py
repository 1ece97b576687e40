"""The in-process generation backends on a loaded Hugging Face model: "hf" (batched ``model.generate``),
"decoder" (``stages.generation.decoder``, a lean CPU decode loop with the same tokens) and "auto" (the
decoder where ``decoder.why_not`` allows it, ``model.generate`` otherwise). ``Generations.backend`` says
which ran.

Prompts are rendered with the chat template, tokenised once, sorted by length (less left padding), cut into
batches of ``batch_size`` prompts, left-padded and generated with the KV cache; each prompt's ``n``
completions come back in the original, prompt-major order. Sampling does not use torch's global RNG: each
prompt's rows draw their uniforms from a generator seeded with ``prompt_seed(seed, prompt ids)``, and
``row_sampling.PerRowSampler`` picks each row's token by inverse-CDF from the filtered distribution, so a
prompt gets the same completions whatever its batch, position, rank or shard. Beam search stays HF's own,
inside ``torch.random.fork_rng``; the caller's RNG state is left as it was. Sampled completions come with
``Generations.logprobs``, each token's log-probability under the distribution it was drawn from.
"""
from __future__ import annotations

import os

import torch

from stages.generation.common import (
    Generations,
    SamplingParams,
    build_generations,
    eos_token_ids,
    render_and_tokenize,
    trim_at_eos,
)
from stages.sharding import generate_kwargs
from stages.tensors import pad

CHOICES = ("auto", "hf", "decoder")


def generate(model, tokenizer, prompts: list, sampling: SamplingParams, *, batch_size: int = 64,
             progress: bool = False, backend: str = "auto", tools: list | None = None) -> Generations:
    """Completions of ``prompts`` from an HF causal LM (see :func:`stages.generation.generate`).

    ``model`` may also be a model folder / hub id (loaded on CPU in float32, with its tokenizer
    when ``tokenizer`` is None). The model is put in eval mode for the call and its previous
    train/eval mode is restored afterwards; no gradients are computed. ``backend``: a ``CHOICES`` entry;
    "decoder" raises ValueError with the reason when the decoder cannot run this model or decoding.
    """
    if backend not in CHOICES:
        raise ValueError(f"generation backend = {backend!r}: not an in-process backend; "
                         f"choose from {', '.join(CHOICES)}")
    if isinstance(model, (str, os.PathLike)):
        from stages.models import load_causal_lm, load_tokenizer

        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model))
        model = load_causal_lm(str(model))
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an int >= 1 (prompts per generate call)")
    eos = eos_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rendered, prompt_ids = prompt_token_ids(tokenizer, prompts, tools)

    per_row = sampling.do_sample and sampling.num_beams == 1
    kwargs = {**_generate_kwargs(sampling, eos, pad_id, per_row), **generate_kwargs(model)}
    n = sampling.n
    order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))
    per_prompt: list[list[list[int]]] = [[] for _ in prompts]
    per_prompt_logps: list[list[list[float]]] | None = [[] for _ in prompts] if per_row else None
    device = next(model.parameters()).device
    ran: set[str] = set()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices()):
            torch.manual_seed(sampling.seed)  # beam sampling only: HF's sampler reads the global RNG
            bar = _progress_bar(len(prompts), progress)
            for start in range(0, len(order), batch_size):
                batch = order[start: start + batch_size]
                rows = [torch.tensor(prompt_ids[i], dtype=torch.long) for i in batch]
                input_ids = pad(rows, pad_id, "left").to(device)
                attention_mask = pad([torch.ones_like(r) for r in rows], 0, "left").to(device)
                extra = {}
                if per_row:  # n consecutive rows per prompt, as HF's num_return_sequences lays them out
                    from stages.generation.per_row_sampler import per_row_sampler

                    extra["logits_processor"] = per_row_sampler([prompt_ids[i] for i in batch], sampling,
                                                                input_ids.shape[1], device)
                new = _decode(model, input_ids, attention_mask, n if per_row else 1, sampling, kwargs, extra, eos,
                              pad_id, backend, ran).tolist()
                # n consecutive rows per prompt (HF's num_return_sequences: best beam first)
                for j, i in enumerate(batch):
                    per_prompt[i] = [trim_at_eos(r, eos) for r in new[j * n:(j + 1) * n]]
                if per_row:  # the sampled tokens' log-probs, cut to each completion's length
                    assert per_prompt_logps is not None  # a list whenever per_row
                    steps = extra["logits_processor"][0].logps
                    logps = torch.stack(steps, 1).tolist() if steps else [[] for _ in new]
                    for j, i in enumerate(batch):
                        per_prompt_logps[i] = [logps[j * n + k][:len(c)] for k, c in enumerate(per_prompt[i])]
                if bar is not None:
                    bar.advance(len(batch))
            if bar is not None:
                bar.finish()
    finally:
        model.train(was_training)
    return build_generations(tokenizer, prompts, rendered, prompt_ids, per_prompt, eos, seed=sampling.seed,
                             backend="+".join(sorted(ran)) or _label(backend), logprobs=per_prompt_logps)


def prompt_token_ids(tokenizer, prompts: list, tools: list | None = None) -> tuple[list[str], list[list[int]]]:
    """(each prompt rendered with the chat template and its row's tools, its token ids; `TokenPrompt`s as they
    are: `render_and_tokenize`); a prompt rendering to no tokens is an error."""
    rendered, prompt_ids = render_and_tokenize(tokenizer, prompts, tools)
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompts[{i}] renders to no tokens; a causal LM needs at least one prompt token")
    return rendered, prompt_ids


def _label(backend: str) -> str:
    """What a call with no prompts reports: the backend it would have tried first."""
    return "hf" if backend == "hf" else "decoder"


def why_not_decoder(model, s: SamplingParams, capacity: int, kwargs: dict, *, check_model: bool = True) -> str | None:
    """Why the decoder cannot produce this call's tokens (None when it can): beam search, a model sharded
    across ranks (generating in lockstep), or (`check_model`) what `decoder.why_not` finds in the model."""
    from stages.generation.decoder import why_not

    if s.num_beams > 1:
        return f"beam search (num_beams = {s.num_beams}): the decoder decodes greedily or samples"
    if s.repetition_penalty != 1.0:
        return (f"repetition_penalty = {s.repetition_penalty}: the penalty reads the tokens so far, which only "
                "generate passes to the sampler")
    if s.generation_kwargs:
        return f"generation_kwargs {sorted(s.generation_kwargs)}: generate's own arguments"
    if s.cache_implementation is not None:
        return f"cache_implementation = {s.cache_implementation!r}: the decoder keeps its own KV cache"
    if "synced_gpus" in kwargs:
        return "a model sharded across ranks generates in lockstep (synced_gpus), which only generate does"
    return why_not(model, capacity) if check_model else None


def _decode(model, input_ids, attention_mask, n: int, s: SamplingParams, kwargs: dict, extra: dict,
            eos: list[int], pad_id: int, backend: str, ran: set[str]) -> torch.Tensor:
    """The new tokens of one batch of prompts, each as `n` consecutive rows: `decoder.Decoder` (lighter
    per step, one prefill per prompt) or HF's `model.generate` over the repeated rows, as `backend` says;
    the one used is added to `ran`."""
    from stages.generation.decoder import Decoder

    width = input_ids.shape[1]
    decoder = None
    if backend != "hf":
        reason = why_not_decoder(model, s, width + s.max_new_tokens, kwargs, check_model=False)
        decoder = None if reason else Decoder.for_model(model, width + s.max_new_tokens)
        if decoder is None and backend == "decoder":
            reason = reason or why_not_decoder(model, s, width + s.max_new_tokens, kwargs)
            raise ValueError(f"generation backend = 'decoder' cannot run here: {reason}; set the backend to auto "
                             "(the decoder where it can run, HF generate otherwise) or hf")
    ran.add("hf" if decoder is None else "decoder")
    if decoder is not None:
        pick = extra["logits_processor"][0].sample if extra else None
        return decoder.generate(input_ids, attention_mask, s.max_new_tokens, eos, pad_id, pick, n=n)
    input_ids, attention_mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **extra)[:, width:]


def _generate_kwargs(s: SamplingParams, eos: list[int], pad_id: int, per_row: bool) -> dict:
    """``model.generate`` arguments. Unset knobs fall back to the model's generation_config, so the
    ones SamplingParams owns are always passed explicitly (top_k=0 overrides HF's default of 50).
    per_row: HF decodes greedily over rows already expanded n times; `PerRowSampler` samples."""
    kw = dict(max_new_tokens=s.max_new_tokens, do_sample=s.do_sample and not per_row, num_beams=s.num_beams,
              num_return_sequences=1 if per_row else s.n, use_cache=True, eos_token_id=eos, pad_token_id=pad_id,
              **(s.generation_kwargs or {}))
    if s.cache_implementation is not None:
        kw["cache_implementation"] = s.cache_implementation
    if not per_row:  # per_row: PerRowSampler applies the penalty and the warpers itself (greedy HF underneath)
        kw["repetition_penalty"] = float(s.repetition_penalty)
    if s.do_sample and not per_row:
        kw.update(temperature=float(s.temperature), top_p=float(s.top_p), top_k=s.top_k, min_p=s.min_p or None)
    return kw


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    import logging

    from stages.basics import Progress

    return Progress(logging.getLogger("stages.generation"), total=total, unit="prompts", what="generate")
