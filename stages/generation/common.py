"""What every generation backend shares: the result record (the sampling parameters: `stages.sampling`),
turning generated token ids into it (EOS trimming, decoding, the reasoning-block policy), and the count of which
backends ran in this process (`record_backend`, `take_backends`: the stage runner writes them into the manifest).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stages.basics import stable_seed
from stages.completion_text import THINK_TAGS, parse_completions
from stages.sampling import SamplingParams  # noqa: F401 (the backends' argument, re-exported)
from stages.tensors import pad


@dataclass
class Generations:
    """Completions of P prompts, n per prompt, in prompt-major order.

    Attributes:
        prompts: the P input prompts (strings or chat message lists), as given.
        prompt_index: len P*n: which prompt each completion belongs to
            (all n completions of prompt 0, then prompt 1, ...).
        prompt_ids: len P: the tokenised rendered prompt (chat template + generation prompt), no padding.
        completion_ids: len P*n: generated tokens up to and including the first EOS; no padding.
        completions: len P*n: the text reward functions score (``stages.completion_text.decode_and_strip_padding``).
        reasoning: len P*n: the ``<think>`` block text, or None.
        finished: len P*n: ended with EOS and no open reasoning block (False: cut at max_new_tokens).
        seed: the sampling seed.
        backend: the backend that produced them.
        logprobs: len P*n, each as long as its completion_ids: log-probability of each sampled token
            under the distribution the sampler drew it from (temperature, top-k, top-p applied; NaN where
            the server gave none); None when the decoding was not sampling (greedy, beams). Off-policy
            corrections divide by these (`stages.losses.truncated_importance_weights`).
    """

    prompts: list
    prompt_index: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[str]
    reasoning: list[str | None]
    finished: list[bool]
    seed: int
    backend: str
    logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def reward_columns(self, rows: list[dict], skip: tuple[str, ...] = ("prompt",)) -> dict[str, list]:
        """The `**columns` of reward functions: each prompt row's other columns repeated per completion
        (`rows[i]` is prompt i's row), plus completion_ids, reasoning and finished."""
        names = dict.fromkeys(k for r in rows for k in r if k not in skip)
        columns: dict[str, list] = {k: [rows[i].get(k) for i in self.prompt_index] for k in names}
        columns.update(completion_ids=self.completion_ids, reasoning=self.reasoning, finished=self.finished)
        return columns


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids, generated from as is (never re-rendered or re-tokenised): a multi-turn
    episode's context (`stages.tools.episodes`). text: its decoded text, for the reasoning-block check."""

    ids: tuple[int, ...]
    text: str


def render_and_tokenize(tokenizer, prompts: list, tools: list | None = None) -> tuple[list[str], list[list[int]]]:
    """(rendered texts, token ids) of prompts: strings and message lists rendered with the chat template (with
    each prompt's `tools`, None for none) and tokenised without special tokens; `TokenPrompt`s taken as they are."""
    from stages.data.tokenize import render_prompt

    per_prompt = tools if tools is not None else [None] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"tools: {len(per_prompt)} entries for {len(prompts)} prompts (one list per prompt, or None)")
    rendered = [p.text if isinstance(p, TokenPrompt) else render_prompt(tokenizer, p, t)
                for p, t in zip(prompts, per_prompt, strict=True)]
    todo = [i for i, p in enumerate(prompts) if not isinstance(p, TokenPrompt)]
    ids: list[list[int]] = [list(p.ids) if isinstance(p, TokenPrompt) else [] for p in prompts]
    if todo:
        for i, row in zip(todo, tokenizer([rendered[i] for i in todo], add_special_tokens=False)["input_ids"],
                          strict=True):
            ids[i] = list(row)
    return rendered, ids


def prompt_seed(seed: int, prompt_ids: Sequence[int]) -> int:
    """The seed of one prompt's completions: a stable hash of the call's seed and the rendered prompt's
    token ids. Neither the batch, the prompt's position in it, the rank nor the shard enters."""
    return stable_seed(seed, prompt_ids)


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """The stop ids: the tokenizer's EOS plus any the model's generation config lists (in that order)."""
    ids: list[int] = []
    sources = [getattr(tokenizer, "eos_token_id", None)]
    gen_config = getattr(model, "generation_config", None)
    sources.append(getattr(gen_config, "eos_token_id", None))
    for src in sources:
        for i in [src] if isinstance(src, int) else list(src or []):
            if i not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no eos_token and the model's "
                         "generation config lists no eos_token_id: generation could not stop; set tokenizer.eos_token")
    return ids


def trim_at_eos(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """``ids`` up to and including the first EOS (all of it when there is none)."""
    stop = set(eos)
    for i, t in enumerate(ids):
        if t in stop:
            return list(ids[: i + 1])
    return list(ids)


_BACKENDS_RAN: set[str] = set()


def record_backend(name: str) -> None:
    """Note that backend `name` ("hf", "decoder", "vllm") produced completions in this process."""
    _BACKENDS_RAN.add(name)


def take_backends() -> list[str]:
    """The backends that ran since the last call, sorted; the record is cleared."""
    names = sorted(_BACKENDS_RAN)
    _BACKENDS_RAN.clear()
    return names


def build_generations(tokenizer, prompts: list, rendered: list[str], prompt_ids: list[list[int]],
                      completion_ids: list[list[list[int]]], eos: list[int], *, seed: int, backend: str,
                      logprobs: list[list[list[float]]] | None = None) -> Generations:
    """Assemble Generations from per-prompt lists of completions (``completion_ids[p][k]``, already EOS-trimmed)
    and, when sampled, their tokens' log-probs (``logprobs[p][k]``, as long as ``completion_ids[p][k]``).

    Prompts whose rendered text ends with ``<think>`` (templates that open the reasoning
    block themselves) are parsed with ``thinking_in_prompt=True``.
    """
    index = [p for p, comps in enumerate(completion_ids) for _ in comps]
    flat = [c for comps in completion_ids for c in comps]
    flat_logps = None if logprobs is None else [list(map(float, lp)) for rows in logprobs for lp in rows]
    if flat_logps is not None:
        # strict=False: a count mismatch is reported just below, with the backend named
        bad = [i for i, (c, lp) in enumerate(zip(flat, flat_logps, strict=False)) if len(c) != len(lp)]
        if bad or len(flat_logps) != len(flat):
            raise ValueError(f"{backend}: sampled log-probs do not line up with the completion tokens (first: "
                             f"completion {bad[0] if bad else len(flat_logps)}); this is a backend bug")
    for name in backend.split("+"):
        record_backend(name)
    opens = [rendered[p].rstrip().endswith(THINK_TAGS[0]) for p in index]
    parsed: list = [None] * len(flat)
    for flag in (False, True):
        rows = [i for i, o in enumerate(opens) if o == flag]
        if rows:
            for i, c in zip(rows, _parse(tokenizer, [flat[i] for i in rows], eos, flag), strict=True):
                parsed[i] = c
    return Generations(
        prompts=list(prompts), prompt_index=index, prompt_ids=[list(p) for p in prompt_ids], completion_ids=flat,
        completions=[c.answer for c in parsed], reasoning=[c.reasoning for c in parsed],
        finished=[c.finished for c in parsed], seed=seed, backend=backend, logprobs=flat_logps,
    )


def _parse(tokenizer, rows: list[list[int]], eos: list[int], thinking_in_prompt: bool):
    tensors = [torch.tensor(r, dtype=torch.long) for r in rows]
    ids = pad(tensors, 0, "right")
    mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], 0, "right")
    if ids.shape[1] == 0:  # every completion empty: give the parser one masked-out column
        ids, mask = torch.zeros(len(rows), 1, dtype=torch.long), torch.zeros(len(rows), 1, dtype=torch.long)
    return parse_completions(ids, tokenizer, mask=mask, think_tags=THINK_TAGS, thinking_in_prompt=thinking_in_prompt,
                             eos_token_id=eos)
