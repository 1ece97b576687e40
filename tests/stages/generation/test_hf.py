"""The "hf" generation backend on the built-in tiny model: batching, seeding, ordering, stopping, errors."""
import copy

import pytest
import torch

from stages.builtin import tiny
from stages.completion_text import decode_and_strip_padding
from stages.data.tokenize import render_prompt
from stages.generation import BACKENDS, Generations, SamplingParams, generate

from .conftest import PROMPTS

EOS = 1  # <|end|> in the built-in tokenizer


def _greedy_slow(model, tok, prompt, max_new_tokens):
    """The obvious version: no padding, no KV cache, full forward and argmax each step."""
    ids = tok(render_prompt(tok, prompt), add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == EOS:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_greedy_batched_equals_one_at_a_time_and_the_slow_loop(model, tok):
    greedy = SamplingParams(max_new_tokens=12)
    batched = generate(model, tok, PROMPTS, greedy, batch_size=3)
    assert len({len(p) for p in batched.prompt_ids}) >= 4  # batches really mix lengths (left padding)
    single = [generate(model, tok, [p], greedy).completion_ids[0] for p in PROMPTS]
    assert batched.completion_ids == single
    assert len({tuple(c) for c in single}) >= 6  # outputs depend on the prompt, so a mix-up would show
    assert batched.completion_ids == [_greedy_slow(model, tok, p, 12) for p in PROMPTS]
    expected_ids = [tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert batched.prompt_ids == expected_ids
    assert batched.prompt_index == list(range(len(PROMPTS)))
    assert batched.backend == "decoder" and batched.prompts == PROMPTS


def test_sampling_is_reproducible_per_seed_and_leaves_the_global_rng_alone(model, tok):
    def run(seed):
        return generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=10, do_sample=True, n=2, seed=seed),
                        batch_size=4).completion_ids

    state = torch.get_rng_state()
    first = run(1)
    assert torch.equal(torch.get_rng_state(), state)  # a trainer's RNG stream is not reset by generation
    assert run(1) == first
    assert run(2) != first


def test_n_samples_come_back_prompt_major(model, tok):
    """top_k=1 sampling is greedy, so every sample must equal its own prompt's greedy completion."""
    n = 3
    greedy = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=8)).completion_ids
    gens = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=8, do_sample=True, top_k=1, n=n),
                    batch_size=4)
    assert len(gens) == n * len(PROMPTS)
    assert gens.prompt_index == [p for p in range(len(PROMPTS)) for _ in range(n)]
    assert gens.completion_ids == [greedy[p] for p in gens.prompt_index]
    for field in (gens.completions, gens.reasoning, gens.finished):
        assert len(field) == n * len(PROMPTS)


def test_samples_within_a_prompt_differ(model, tok):
    gens = generate(model, tok, PROMPTS[:4], SamplingParams(max_new_tokens=10, do_sample=True, n=4, seed=0))
    for p in range(4):
        assert len({tuple(gens.completion_ids[4 * p + k]) for k in range(4)}) > 1


def _sum_logp(model, prompt_ids, completion):
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
    tgt = ids[0, 1:]
    return float(logp.gather(-1, tgt[:, None]).squeeze(-1)[len(prompt_ids) - 1:].sum())


def test_beam_search_returns_the_n_best_beams(model, tok):
    prompts = PROMPTS[:4]
    beams = generate(model, tok, prompts, SamplingParams(max_new_tokens=6, num_beams=4, n=2), batch_size=2)
    greedy = generate(model, tok, prompts, SamplingParams(max_new_tokens=6))
    assert beams.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    for p in range(len(prompts)):
        best, second = beams.completion_ids[2 * p], beams.completion_ids[2 * p + 1]
        assert best != second
        ids = beams.prompt_ids[p]
        assert len(best) == len(second) == len(greedy.completion_ids[p]) == 6  # no EOS: scores compare directly
        assert _sum_logp(model, ids, best) >= _sum_logp(model, ids, second) - 1e-5
        assert _sum_logp(model, ids, best) >= _sum_logp(model, ids, greedy.completion_ids[p]) - 1e-5
    assert beams.completion_ids[::2] != greedy.completion_ids  # beam search found other, likelier sequences


def test_eos_trims_and_sets_finished(model, tok):
    """Make a token the greedy run emits mid-way a stop id: completions end right after it."""
    plain = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=12))
    row = plain.completion_ids[0]
    stop = next(t for t in row[2:] if t != EOS)
    cut = row.index(stop)
    stopped = copy.deepcopy(model)
    stopped.generation_config.eos_token_id = [EOS, stop]
    gens = generate(stopped, tok, PROMPTS, SamplingParams(max_new_tokens=12), batch_size=4)
    assert gens.completion_ids[0] == row[: cut + 1] and gens.finished[0]
    for before, after, done in zip(plain.completion_ids, gens.completion_ids, gens.finished, strict=True):
        hits = [i for i, t in enumerate(before) if t in (EOS, stop)]
        assert after == (before[: hits[0] + 1] if hits else before)
        assert done == bool(hits)
    width = max(map(len, gens.completion_ids))
    padded = [c + [tok.pad_token_id] * (width - len(c)) for c in gens.completion_ids]
    assert gens.completions == decode_and_strip_padding(padded, tok, eos_token_id=[EOS, stop])


def test_max_new_tokens_is_respected(model, tok):
    for m in (1, 5):
        gens = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=m, do_sample=True, n=2))
        for ids, done in zip(gens.completion_ids, gens.finished, strict=True):
            assert len(ids) == m or (done and ids[-1] == EOS and len(ids) <= m)
            assert done == (ids[-1] == EOS)


def test_train_mode_and_tokenizer_are_restored_and_no_gradients(model, tok):
    model.train()
    side = tok.padding_side
    generate(model, tok, PROMPTS[:3], SamplingParams(max_new_tokens=4, do_sample=True))
    assert model.training and all(m.training for m in model.modules())
    assert tok.padding_side == side
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    generate(model, tok, PROMPTS[:3], SamplingParams(max_new_tokens=4))
    assert not model.training


def test_pad_equal_to_eos(model, tok):
    """Finished rows are padded with the pad id = EOS: exactly one EOS survives, at the end."""
    stopped = copy.deepcopy(model)
    ref = generate(stopped, tok, PROMPTS, SamplingParams(max_new_tokens=12))
    stop = next(t for t in ref.completion_ids[0][2:] if t != EOS)
    stopped.generation_config.eos_token_id = [EOS, stop]
    distinct = generate(stopped, tok, PROMPTS, SamplingParams(max_new_tokens=12), batch_size=5)
    same = copy.deepcopy(tok)
    same.pad_token = same.eos_token
    assert same.pad_token_id == EOS
    shared = generate(stopped, same, PROMPTS, SamplingParams(max_new_tokens=12), batch_size=5)
    assert shared.completion_ids == distinct.completion_ids
    assert shared.finished == distinct.finished and any(shared.finished) and not all(shared.finished)
    for ids in shared.completion_ids:
        assert sum(t in (EOS, stop) for t in ids) <= 1


def test_model_path_and_empty_prompt_list(tiny_path, model, tok):
    by_path = generate(str(tiny_path), tok, PROMPTS[:2], SamplingParams(max_new_tokens=5))
    loaded = generate(model, tok, PROMPTS[:2], SamplingParams(max_new_tokens=5))
    assert by_path.completion_ids == loaded.completion_ids
    empty = generate(model, tok, [], SamplingParams())
    assert isinstance(empty, Generations) and empty.completion_ids == [] and empty.prompt_ids == []


def test_plain_prompts_and_a_template_that_opens_the_reasoning_block(model, tok):
    gens = generate(model, tok, ["plain text prompt"], SamplingParams(max_new_tokens=3))
    assert gens.prompt_ids[0] == tok("plain text prompt", add_special_tokens=False)["input_ids"]
    thinking = copy.deepcopy(tok)
    thinking.chat_template = tiny.CHAT_TEMPLATE.replace("'<|assistant|>\n' -}}{%- endif",
                                                        "'<|assistant|>\n<think>' -}}{%- endif")
    assert render_prompt(thinking, PROMPTS[0]).endswith("<think>")
    gens = generate(model, thinking, PROMPTS[:8], SamplingParams(max_new_tokens=6))  # the chat prompts
    close = tok.convert_tokens_to_ids("</think>")
    open_rows = [i for i, ids in enumerate(gens.completion_ids) if close not in ids]
    assert open_rows  # the block the prompt opened is never closed in 6 random tokens: no answer, all reasoning
    for i in open_rows:
        assert gens.completions[i] == "" and gens.reasoning[i] is not None and not gens.finished[i]
    mixed = generate(model, thinking, PROMPTS[:2] + ["plain"], SamplingParams(max_new_tokens=6))
    assert mixed.reasoning[2] is None and mixed.reasoning[0] is not None  # the plain prompt opens no block


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=0), "SamplingParams.n = 0"),
    (dict(do_sample=True, temperature=0.0), "SamplingParams.temperature = 0.0"),
    (dict(top_p=0.0), "SamplingParams.top_p = 0.0"),
    (dict(top_p=1.5), "SamplingParams.top_p = 1.5"),
    (dict(num_beams=2, n=3), "set num_beams >= 3"),
    (dict(n=2), "identical completions"),
    (dict(max_new_tokens=0), "SamplingParams.max_new_tokens = 0"),
    (dict(top_k=-1), "SamplingParams.top_k = -1"),
])
def test_invalid_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match="invalid sampling parameters") as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as err:
        SamplingParams(n=0, top_p=2.0, max_new_tokens=0)
    assert all(k in str(err.value) for k in ("SamplingParams.n", "SamplingParams.top_p", "max_new_tokens"))


def test_unknown_backend_and_bad_arguments(model, tok):
    with pytest.raises(ValueError, match=r"backend = 'sglang'.*auto, hf, decoder, vllm"):
        generate(model, tok, PROMPTS, SamplingParams(), backend="sglang")
    assert set(BACKENDS) == {"auto", "hf", "decoder", "vllm", "continuous_batching"}
    with pytest.raises(ValueError, match="SamplingParams"):
        generate(model, tok, PROMPTS, {"n": 1})
    with pytest.raises(ValueError, match="batch_size = 0"):
        generate(model, tok, PROMPTS, SamplingParams(), batch_size=0)


def test_repetition_penalty_generation_kwargs_and_cache_are_generates_own(model, tok):
    """Greedy with repetition_penalty, a generate argument through generation_kwargs and a cache implementation:
    the tokens HF generate gives with the same arguments; the auto backend leaves them to HF generate (the
    decoder steps aside), and a key SamplingParams owns is refused in generation_kwargs."""
    s = SamplingParams(max_new_tokens=8, repetition_penalty=1.5, generation_kwargs={"no_repeat_ngram_size": 1},
                       cache_implementation="dynamic")
    gens = generate(model, tok, PROMPTS[:3], s, backend="auto")
    assert gens.backend == "hf"
    for prompt, completion in zip(PROMPTS[:3], gens.completion_ids, strict=True):
        ids = tok(render_prompt(tok, prompt), add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.5,
                                 no_repeat_ngram_size=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        expected = out[0, ids.shape[1]:].tolist()
        assert completion == expected[:len(completion)] and len(set(completion)) == len(completion)
    with pytest.raises(ValueError, match=r"generation_kwargs sets \['temperature'\]"):
        SamplingParams(do_sample=True, generation_kwargs={"temperature": 0.5})
    with pytest.raises(ValueError, match="generation backend = 'decoder' cannot run here: repetition_penalty"):
        generate(model, tok, PROMPTS[:1], SamplingParams(repetition_penalty=1.2), backend="decoder")
