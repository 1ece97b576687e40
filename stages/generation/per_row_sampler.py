"""Sampling each row of a batched HF `generate` from its own prompt-seeded uniforms (see `stages.generation.hf`).

HF's sampler draws from torch's global RNG across the whole batch, so a prompt's samples depend
on what else is in its batch. Here HF decodes greedily and `PerRowSampler`, its last logits
processor, does the sampling: row r's token t is the inverse-CDF sample of the filtered
distribution at uniform u[r, t], and only that token is left for the argmax. The uniforms of a
prompt's n rows come from a generator seeded with `prompt_seed(seed, prompt ids)`.

`PerRowSampler.logps` keeps the log-probability of every sampled token under the distribution it was
drawn from (after the repetition penalty, temperature, top-k, top-p and min-p): what an off-policy
correction divides by.
"""
from __future__ import annotations

import math

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stages.generation.common import SamplingParams, prompt_seed


def per_row_sampler(prompt_ids: list[list[int]], s: SamplingParams, start: int, device) -> LogitsProcessorList:
    """The `logits_processor` of one batch of prompts whose rows are expanded n times (prompt-major);
    its only element is the `PerRowSampler` (read its `logps` after `generate`)."""
    return LogitsProcessorList([PerRowSampler(row_uniforms(prompt_ids, s).to(device), start, s)])


def row_uniforms(prompt_ids: list[list[int]], s: SamplingParams) -> torch.Tensor:
    """U(0, 1) draws of each prompt's n rows, one per generated token: (P·n, max_new_tokens), float64.

    Prompt p's block comes from its own generator seeded with `prompt_seed(s.seed, prompt_ids[p])`,
    so it is the same in any batch."""
    blocks = [torch.rand((s.n, s.max_new_tokens), dtype=torch.float64,
                         generator=torch.Generator().manual_seed(prompt_seed(s.seed, ids))) for ids in prompt_ids]
    return torch.cat(blocks)


class PerRowSampler(LogitsProcessor):
    """Sample every row from its own uniforms; return logits that leave only the sampled token.

    uniforms: (B, max_new_tokens) from `row_uniforms`; start: the input width, so the token being
    generated is number input_ids.shape[1] - start. The repetition penalty (which needs `input_ids`), then
    temperature, top-k, top-p and min-p are HF's own processors and warpers, applied in HF's order; the
    sample is the first token whose cumulative probability (float64) exceeds u · total. After the call,
    `logps` holds one (B,) float64 tensor per generated token: log-probability of the sampled token under
    the filtered distribution.
    """

    def __init__(self, uniforms: torch.Tensor, start: int, s: SamplingParams):
        self.uniforms, self.start = uniforms, start
        self.logps: list[torch.Tensor] = []
        self.warpers = LogitsProcessorList()
        if s.repetition_penalty != 1.0:
            self.warpers.append(RepetitionPenaltyLogitsProcessor(float(s.repetition_penalty)))
        if s.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(float(s.temperature)))
        if s.top_k:
            self.warpers.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(float(s.top_p)))
        if s.min_p > 0:
            self.warpers.append(MinPLogitsWarper(float(s.min_p)))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token = self.sample(input_ids.shape[1] - self.start, scores, input_ids)
        return torch.full_like(scores, -math.inf).scatter_(1, token, 0.0)

    def sample(self, step: int, scores: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's (B, 1) token number `step` from its (B, V) logits (what `stages.generation.decoder`
        calls directly); its log-prob is appended to `logps`."""
        logits = self.warpers(input_ids, scores.float())
        probs = logits.double().softmax(-1)
        cdf = probs.cumsum(-1)
        total = cdf[:, -1:]
        u = self.uniforms[:, step, None] * total
        last = (cdf < total).sum(-1, keepdim=True)  # the last token of non-zero probability (u·total rounding to it)
        token = torch.minimum(torch.searchsorted(cdf, u, right=True), last)
        self.logps.append(probs.gather(1, token).squeeze(1).log())  # the log-softmax at the token, in float64
        return token
