"""The "continuous_batching" backend (transformers' generate_batch, on CPU) on the built-in tiny model: the greedy
tokens of plain generate, sampled tokens with their true log-probs, seeded calls, refusals, the cache size."""
import pytest
import torch

from stages.generation import SamplingParams, generate
from stages.generation.continuous import engine_config
from stages.sampling import GENERATION_BACKENDS

from .conftest import PROMPTS

SMALL = {"page_size": 16}  # small pages: the cache stays a few kB on CPU


def test_it_is_a_backend_and_a_setting():
    assert "continuous_batching" in GENERATION_BACKENDS


def test_greedy_tokens_are_plain_generates(model, tok):
    greedy = SamplingParams(max_new_tokens=10)
    paged = generate(model, tok, PROMPTS, greedy, backend="continuous_batching", config=SMALL)
    plain = generate(model, tok, PROMPTS, greedy, backend="hf")
    assert paged.backend == "continuous_batching" and plain.backend == "hf"
    assert paged.completion_ids == plain.completion_ids and paged.prompt_index == plain.prompt_index
    assert len({tuple(c) for c in paged.completion_ids}) >= 6  # outputs depend on the prompt: a mix-up would show
    assert paged.completions == plain.completions and paged.logprobs is None


def test_sampled_tokens_carry_their_log_probs_and_a_seed_repeats_the_call(model, tok):
    """Each sampled token's log-prob is log softmax(logits / T) of the model at its position (top_k 0, top_p 1:
    nothing filtered), checked with one plain forward per completion; the same seed gives the same call."""
    s = SamplingParams(max_new_tokens=8, n=3, do_sample=True, temperature=0.7, seed=11)
    prompts = PROMPTS[:4]
    first = generate(model, tok, prompts, s, backend="continuous_batching", config=SMALL)
    again = generate(model, tok, prompts, s, backend="continuous_batching", config=SMALL)
    assert first.completion_ids == again.completion_ids
    assert len({tuple(c) for c in first.completion_ids}) > len(prompts)  # sampled: a prompt's completions differ
    for k, ids in enumerate(first.completion_ids):
        prompt = first.prompt_ids[first.prompt_index[k]]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(first.logprobs[k]), expected, atol=2e-4, rtol=1e-4)


def test_top_k_one_samples_the_greedy_tokens(model, tok):
    sampled = generate(model, tok, PROMPTS[:5], SamplingParams(max_new_tokens=8, do_sample=True, top_k=1, seed=3),
                       backend="continuous_batching", config=SMALL)
    greedy = generate(model, tok, PROMPTS[:5], SamplingParams(max_new_tokens=8), backend="hf")
    assert sampled.completion_ids == greedy.completion_ids


@pytest.mark.parametrize("setting, reason", [({"repetition_penalty": 1.2}, "repetition_penalty = 1.2"),
                                             ({"min_p": 0.1}, "min_p = 0.1"),
                                             ({"num_beams": 2, "n": 1, "do_sample": False}, "beam search"),
                                             ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "generation_kwargs")])
def test_settings_the_engine_cannot_run_are_refused(model, tok, setting, reason):
    s = SamplingParams(**{"max_new_tokens": 4, "do_sample": True, **setting})
    with pytest.raises(ValueError, match=rf"generation backend = 'continuous_batching' cannot decode with {reason}"):
        generate(model, tok, PROMPTS[:2], s, backend="continuous_batching")


def test_the_cache_is_sized_to_the_requests_unless_sized_or_asked_for_a_memory_share():
    requests, s = [[1] * 30, [2] * 5, [3] * 12], SamplingParams(max_new_tokens=20, seed=4, do_sample=True)
    cb = engine_config({"page_size": 16}, requests, s)
    assert cb.num_blocks == 3 * 4 and cb.seed == 4 and cb.return_logprobs  # 30 + 20 tokens: 4 pages of 16
    assert cb.drop_unsupported_processors is False
    assert engine_config({"num_blocks": 7}, requests, s).num_blocks == 7
    assert engine_config({"max_memory_percent": 0.5}, requests, s).num_blocks is None
    with pytest.raises(ValueError, match=r"transformers_continuous_batching_config = \{'page_sise': 16\}: .*"
                                         r"ContinuousBatchingConfig"):
        engine_config({"page_sise": 16}, requests, s)
