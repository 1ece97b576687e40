"""Sampling seeded per prompt (stages.generation.per_row_sampler): a prompt's completions do not depend on where it
lands.

The rank half of "alone, in a batch of 8, on rank 1 of 2" is in tests/distributed/test_no_skip.py (a real
2-process run samples the same prompt on rank 1); here the seed formula is checked to take no rank at all.
"""
import hashlib
import inspect

import torch

from stages.basics import stable_seed
from stages.data.tokenize import render_prompt
from stages.generation import SamplingParams, generate
from stages.generation.common import prompt_seed
from stages.generation.per_row_sampler import row_uniforms
from stages.trainers.online_generation import sample_online

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
    online = sample_online(model, tok, batch, SamplingParams(max_new_tokens=10, temperature=0.8, n=2, do_sample=True),
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


def _first_token_frequencies(model, tok, s: SamplingParams) -> torch.Tensor:
    gens = generate(model, tok, [PROMPTS[0]], s)
    assert gens.backend in ("hf", "decoder")
    return torch.bincount(torch.tensor([c[0] for c in gens.completion_ids]), minlength=model.config.vocab_size
                          ).double() / s.n


def _first_logits(model, tok) -> tuple[torch.Tensor, list[int]]:
    ids = tok(render_prompt(tok, PROMPTS[0]), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].double(), ids


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one(model, tok):
    """The first tokens of 2000 samples vs the min-p distribution computed by hand: p (temperature 0.3) renormalised
    over the tokens with p >= min_p · max p; total variation < 0.05."""
    s = SamplingParams(max_new_tokens=1, do_sample=True, n=2000, temperature=0.3, min_p=0.2, seed=1)
    logits, _ = _first_logits(model, tok)
    probs = (logits / 0.3).softmax(-1)
    keep = probs >= 0.2 * probs.max()
    want = torch.where(keep, probs, 0.0)
    want = want / want.sum()
    got = _first_token_frequencies(model, tok, s)
    assert 1 < keep.sum() < 50 and set(got.nonzero().flatten().tolist()) <= set(keep.nonzero().flatten().tolist())
    assert 0.5 * (got - want).abs().sum() < 0.05


def test_repetition_penalty_in_the_sampler_by_hand():
    """Scores (2, 1, 0.5, -1, 0) with tokens 0 and 3 already in the row, θ = 2: CTRL's penalty gives
    (1, 1, 0.5, -2, 0). Uniform 0 picks token 0, uniform 0.999 the last token; each logged log-prob is the
    token's log-softmax under the penalised scores."""
    from stages.generation.per_row_sampler import PerRowSampler

    s = SamplingParams(max_new_tokens=1, do_sample=True, n=2, repetition_penalty=2.0)
    sampler = PerRowSampler(torch.tensor([[0.0], [0.999]], dtype=torch.float64), start=2, s=s)
    scores = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]] * 2)
    out = sampler(torch.tensor([[0, 3]] * 2), scores)
    assert out.argmax(-1).tolist() == [0, 4]
    expected = torch.tensor([1.0, 1.0, 0.5, -2.0, 0.0], dtype=torch.float64).log_softmax(-1)
    assert torch.allclose(sampler.logps[0], expected[[0, 4]])


def test_repetition_penalty_reaches_the_per_row_sampler(model, tok):
    """The same seeds with and without a strong penalty: other samples (the penalised distribution)."""
    plain = SamplingParams(max_new_tokens=6, do_sample=True, n=4, seed=3)
    penalised = SamplingParams(max_new_tokens=6, do_sample=True, n=4, seed=3, repetition_penalty=5.0)
    a, b = generate(model, tok, PROMPTS, plain), generate(model, tok, PROMPTS, penalised)
    assert a.completion_ids != b.completion_ids and b.backend == "hf"
