"""Sampling seeded per prompt (stages.generation.per_row_sampler): a prompt's completions do not depend on where it lands.

The rank half of "alone, in a batch of 8, on rank 1 of 2" is in tests/distributed/test_no_skip.py (a real
2-process run samples the same prompt on rank 1); here the seed formula is checked to take no rank at all.
"""
import hashlib
import inspect
import math

import pytest
import torch

from stages.basics import stable_seed
from stages.data.tokenize import render_prompt
from stages.generation import SamplingParams, generate
from stages.generation.common import prompt_seed
from stages.generation.per_row_sampler import row_uniforms
from stages.trainers.online_generation import GenerationParams, sample_online

from .conftest import PROMPTS

EOS = 1


def _sampled_slow(model, tok, prompt, s: SamplingParams) -> list[list[int]]:
    """The obvious version: one row at a time, no padding, no KV cache, full softmax, a Python CDF walk over the
    same uniforms (temperature only: top-k and top-p are HF's own warpers)."""
    ids = tok(render_prompt(tok, prompt), add_special_tokens=False)["input_ids"]
    u = row_uniforms([ids], s)
    rows = []
    with torch.no_grad():
        for r in range(s.n):
            seq, out = list(ids), []
            for t in range(s.max_new_tokens):
                probs = (model(input_ids=torch.tensor([seq])).logits[0, -1].double() / s.temperature).softmax(-1)
                target, acc, pick = u[r, t].item() * probs.sum().item(), 0.0, len(probs) - 1
                for k, p in enumerate(probs.tolist()):
                    acc += p
                    if acc > target:
                        pick = k
                        break
                out.append(pick)
                seq.append(pick)
                if pick == EOS:
                    break
            rows.append(out)
    return rows


def test_a_prompt_samples_alike_alone_in_a_batch_of_8_and_at_any_position(model, tok):
    s = SamplingParams(max_new_tokens=10, do_sample=True, n=2, temperature=0.8, seed=stable_seed(0, 3))
    target = PROMPTS[1]
    alone = generate(model, tok, [target], s).completion_ids
    batch = PROMPTS[2:7] + [target] + PROMPTS[7:9]  # 8 prompts of mixed lengths: left padding around it
    assert len(batch) == 8
    in_8 = generate(model, tok, batch, s, batch_size=8)
    in_3 = generate(model, tok, list(reversed(batch)), s, batch_size=3)  # another batch, another position
    assert in_8.completion_ids[10:12] == alone == in_3.completion_ids[4:6]
    assert alone == _sampled_slow(model, tok, target, s)
    assert alone[0] != alone[1]  # the n rows of a prompt draw their own uniforms
    other_step = generate(model, tok, [target], SamplingParams(**{**s.__dict__, "seed": stable_seed(0, 4)}))
    assert other_step.completion_ids != alone  # the draw (optimizer step) enters the seed
    # through the online trainers' entry point too: the same seed formula and per-prompt seeds
    online = sample_online(model, tok, batch, GenerationParams(max_new_tokens=10, temperature=0.8), n=2,
                           seed=stable_seed(0, 3))
    assert online.completion_ids[10:12] == alone


def test_the_seed_takes_the_run_seed_draw_and_prompt_only():
    """No rank or batch position is an input: rank 1 of 2 computes the seeds rank 0 (or one process) does."""
    assert list(inspect.signature(prompt_seed).parameters) == ["seed", "prompt_ids"]
    seeds = {stable_seed(seed, draw) for seed in range(3) for draw in range(100)}
    assert len(seeds) == 300 and all(0 <= x < 2 ** 63 for x in seeds)
    assert stable_seed(1, 100_003) != stable_seed(100_004, 0)  # not an arithmetic combination
    assert prompt_seed(5, [1, 2, 3]) == prompt_seed(5, (1, 2, 3)) != prompt_seed(5, [1, 2, 4])
    # BLAKE2b, not Python's per-process salted hash: the same in every process and on every machine
    digest = hashlib.blake2b(b"i5;s3:1,2,3;", digest_size=8).digest()
    assert prompt_seed(5, [1, 2, 3]) == int.from_bytes(digest, "big") >> 1


def test_per_row_samples_follow_the_filtered_distribution(model, tok):
    """First tokens of 2000 samples of one prompt vs the temperature/top-k distribution: total variation < 0.05."""
    s = SamplingParams(max_new_tokens=1, do_sample=True, n=2000, temperature=2.0, top_k=8, seed=1)
    ids = tok(render_prompt(tok, PROMPTS[0]), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1] / 2.0
    top = logits.topk(8)
    want = torch.zeros_like(logits).scatter(0, top.indices, top.values.softmax(-1))
    got = torch.bincount(torch.tensor([c[0] for c in generate(model, tok, [PROMPTS[0]], s).completion_ids]),
                         minlength=len(logits)).double() / s.n
    assert set(got.nonzero().flatten().tolist()) <= set(top.indices.tolist())  # top-k filtered
    assert 0.5 * (got - want.double()).abs().sum() < 0.05


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_held_tokens():
    """Row prompt [0, 2], penalty 2: token 0's logit 2.0 -> 1.0, token 2's -1.0 -> -2.0, token 1 untouched; after
    token 1 is sampled it is held too (the decoder passes no input_ids, so the sampler tracks the rows itself)."""
    from stages.generation.per_row_sampler import PerRowSampler

    s = SamplingParams(max_new_tokens=2, do_sample=True, repetition_penalty=2.0)
    sampler = PerRowSampler(torch.tensor([[0.6, 0.5]], dtype=torch.float64), 0, s, row_prompts=[[0, 2]])
    scores = torch.tensor([[2.0, 1.0, -1.0]])
    assert sampler.penalised(scores).tolist() == [[1.0, 1.0, -2.0]]
    token = sampler.sample(0, scores)  # softmax(1, 1, -2) = (0.488, 0.488, 0.024): u = 0.6 falls on token 1
    assert token.tolist() == [[1]]
    assert sampler.penalised(scores).tolist() == [[1.0, 0.5, -2.0]]


def test_min_p_drops_tokens_under_its_share_of_the_top_probability():
    """Probabilities (0.6, 0.3, 0.1): min_p 0.4 keeps tokens >= 0.24 (0 and 1); u = 0.99 then picks token 1, where
    without min_p it picks token 2."""
    from stages.generation.per_row_sampler import PerRowSampler

    scores = torch.tensor([[0.6, 0.3, 0.1]]).log()
    u = torch.tensor([[0.99]], dtype=torch.float64)
    plain = PerRowSampler(u, 0, SamplingParams(max_new_tokens=1, do_sample=True))
    filtered = PerRowSampler(u, 0, SamplingParams(max_new_tokens=1, do_sample=True, min_p=0.4))
    assert plain.sample(0, scores).tolist() == [[2]] and filtered.sample(0, scores).tolist() == [[1]]
    assert filtered.logps[0].item() == pytest.approx(math.log(0.3 / 0.9), abs=1e-6)


def test_decoder_and_hf_sample_alike_with_min_p_and_repetition_penalty(model, tok):
    s = SamplingParams(max_new_tokens=10, do_sample=True, n=2, temperature=0.9, min_p=0.05, repetition_penalty=1.3,
                       seed=4)
    hf = generate(model, tok, PROMPTS[:3], s, backend="hf").completion_ids
    assert generate(model, tok, PROMPTS[:3], s, backend="decoder").completion_ids == hf
    assert generate(model, tok, PROMPTS[:3], SamplingParams(**{**s.__dict__, "repetition_penalty": 1.0}),
                    backend="hf").completion_ids != hf  # the penalty changed what was sampled


def test_bad_sampling_values_are_named():
    with pytest.raises(ValueError, match="min_p = 1.5"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="repetition_penalty = 0"):
        SamplingParams(repetition_penalty=0)
