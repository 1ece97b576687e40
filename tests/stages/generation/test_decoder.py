"""The lean decoder against HF's `generate` on random models of each architecture it covers, and where it steps
aside."""
import pytest
import torch
import torch.nn.functional as F

from stages.generation import SamplingParams, generate
from stages.generation.decoder import Decoder, why_not
from stages.generation.per_row_sampler import per_row_sampler

from .conftest import PROMPTS

SIZE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, eos_token_id=1, pad_token_id=0, bos_token_id=2)


def _model(kind: str, **extra):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    kw = {**SIZE, "num_key_value_heads": 2, **extra}  # grouped-query attention
    if kind == "qwen3":
        kw["head_dim"] = 16  # wider than hidden / heads, as Qwen3's configs allow
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # peaked logits, random biases and norm weights: every weight shows in the tokens
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.3)
    return model


def _batch(rows=6, seed=1):
    """Left-padded prompts of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 5, 12, 1, 7][:rows]
    ids = torch.zeros(rows, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, -n:] = torch.randint(3, SIZE["vocab_size"], (n,), generator=gen)
        mask[r, -n:] = 1
    return ids, mask


def _hf(model, ids, mask, new, **kw):
    kw = {"eos_token_id": [1], **kw}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=0, **kw)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_equal_hf_generate_with_left_padding_and_gqa(kind):
    model = _model(kind, attention_bias=True) if kind in ("llama", "qwen3") else _model(kind)
    ids, mask = _batch()
    assert why_not(model, ids.shape[1] + 20) is None
    ours = Decoder.for_model(model, ids.shape[1] + 20).generate(ids, mask, 20, [1], 0)
    theirs = _hf(model, ids, mask, 20)
    assert torch.equal(ours, theirs)
    assert len({tuple(r) for r in ours.tolist()}) == len(ours)  # the rows differ, so a row mix-up would show


def test_a_cache_that_grows_mid_call_gives_the_same_tokens(monkeypatch):
    import stages.generation.decoder as decoder

    model = _model("llama")
    ids, mask = _batch()
    whole = Decoder(model).generate(ids, mask, 20, [1], 0)
    monkeypatch.setattr(decoder, "FIRST_CACHE_TOKENS", 2)  # grows at new tokens 2, 4, 8, 16
    assert torch.equal(Decoder(model).generate(ids, mask, 20, [1], 0), whole)


def test_prefill_logits_match_the_model_forward():
    model = _model("qwen2")
    ids, mask = _batch()
    captured = []
    decoder = Decoder(model)
    decoder.generate(ids, mask, 1, [1], 0, pick=lambda step, logits: captured.append(logits) or logits.argmax(-1, True))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(captured[0], expected, atol=1e-4, rtol=1e-4)


def _shared_batch(shared=20, suffixes=(4, 1, 7, 3), seed=2):
    """Left-padded prompts that all start with the same `shared` tokens (a system prompt) and end apart."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, SIZE["vocab_size"], (shared,), generator=gen)
    width = shared + max(suffixes)
    ids, mask = torch.zeros(len(suffixes), width, dtype=torch.long), torch.zeros(len(suffixes), width, dtype=torch.long)
    for r, n in enumerate(suffixes):
        ids[r, width - shared - n:] = torch.cat([head, torch.randint(3, SIZE["vocab_size"], (n,), generator=gen)])
        mask[r, width - shared - n:] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_prefix_all_prompts_share_runs_once_and_the_tokens_equal_hf_generate(kind, monkeypatch):
    from stages.generation import decoder

    model = _model(kind, attention_bias=kind != "qwen3")
    ids, mask = _shared_batch()
    calls = []
    layers = decoder.Decoder._layers
    monkeypatch.setattr(decoder.Decoder, "_layers", lambda self, tokens, *a: calls.append(tokens.shape)
                        or layers(self, tokens, *a))
    captured = []
    ours = Decoder(model).generate(ids, mask, 16, [1], 0,
                                   pick=lambda step, logits: captured.append(logits) or logits.argmax(-1, True))
    # the 20 shared tokens once, then every prompt from the longest one's first unshared column (padding: 0 here)
    assert calls[:2] == [(1, 20), (4, ids.shape[1] - 20)]
    assert torch.equal(ours, _hf(model, ids, mask, 16))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(captured[0], expected, atol=1e-4, rtol=1e-4)
    calls.clear()
    short_ids, short_mask = _shared_batch(shared=decoder.SHARED_PREFIX_MIN - 1)
    Decoder(model).generate(short_ids, short_mask, 1, [1], 0)
    assert calls == [short_ids.shape]  # fewer shared tokens: one prefill of every column


def test_per_row_sampling_draws_the_same_tokens_and_logps_as_hf():
    model = _model("llama")
    ids, mask = _batch()
    s = SamplingParams(max_new_tokens=16, n=1, do_sample=True, temperature=0.9, top_p=0.95, top_k=40, seed=3)
    prompts = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
    ours_sampler, hf_sampler = (per_row_sampler(prompts, s, ids.shape[1], "cpu") for _ in range(2))
    ours = Decoder(model).generate(ids, mask, 16, [1], 0, pick=ours_sampler[0].sample)
    theirs = _hf(model, ids, mask, 16, logits_processor=hf_sampler)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(torch.stack(ours_sampler[0].logps), torch.stack(hf_sampler[0].logps), atol=1e-4,
                               rtol=1e-5)  # float32 logits computed in another op order


def test_a_prompts_samples_share_one_prefill_and_equal_hf_on_repeated_rows():
    model = _model("qwen3")
    ids, mask = _batch()
    s = SamplingParams(max_new_tokens=12, n=3, do_sample=True, seed=4)
    prompts = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
    ours_sampler, hf_sampler = (per_row_sampler(prompts, s, ids.shape[1], "cpu") for _ in range(2))
    ours = Decoder(model).generate(ids, mask, 12, [1], 0, pick=ours_sampler[0].sample, n=3)
    theirs = _hf(model, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), 12, logits_processor=hf_sampler)
    assert ours.shape == (3 * len(ids), 12) and torch.equal(ours, theirs)
    assert len({tuple(r) for r in ours[:3].tolist()}) == 3  # one prompt's rows are sampled apart


def test_stops_when_every_row_has_finished_and_pads_after_eos():
    model = _model("llama")
    ids, mask = _batch()
    first = Decoder(model).generate(ids, mask, 1, [1], 0)[:, 0]
    eos = sorted(set(first.tolist()))  # every row's first token is an EOS: one step, then stop
    assert Decoder(model).generate(ids, mask, 10, eos, 0).shape == (len(ids), 1)
    only_row0 = [int(first[0])]  # row 0 stops at once, the others run on
    out = Decoder(model).generate(ids, mask, 8, only_row0, 0)
    assert out[0, 0] == first[0] and (out[0, 1:] == 0).all()
    assert torch.equal(out, _hf(model, ids, mask, 8, eos_token_id=only_row0))


@pytest.mark.parametrize("attention", ["sdpa", "sdpa_cpu_fp32"])
def test_under_bf16_autocast_it_tracks_hf_generate(attention):
    from stages.precision import use_fp32_cpu_attention

    model = _model("qwen2")
    if attention == "sdpa_cpu_fp32":
        use_fp32_cpu_attention(model)
    assert model.config._attn_implementation == attention
    ids, mask = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = Decoder(model).generate(ids, mask, 12, [1], 0)
        theirs = _hf(model, ids, mask, 12)
    # bf16 matmuls round differently in a different op order; on peaked logits the argmax rarely moves
    assert (ours == theirs).float().mean() >= 0.9
    assert torch.equal(ours[:, :3], theirs[:, :3])


def test_the_auto_backend_uses_it_and_gets_hf_generates_completions(model, tok, monkeypatch):
    s = SamplingParams(max_new_tokens=10, n=3, do_sample=True, seed=5)
    calls = []
    real = Decoder.generate
    monkeypatch.setattr(Decoder, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    fast = generate(model, tok, PROMPTS, s, batch_size=4)
    greedy_fast = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=10), batch_size=4)
    assert len(calls) == 6  # 3 batches, twice
    slow = generate(model, tok, PROMPTS, s, batch_size=4, backend="hf")
    assert (fast.backend, slow.backend) == ("decoder", "hf")
    assert fast.completion_ids == slow.completion_ids
    torch.testing.assert_close(torch.tensor([x for r in fast.logprobs for x in r]),
                               torch.tensor([x for r in slow.logprobs for x in r]))
    assert greedy_fast.completion_ids == generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=10),
                                                  batch_size=4, backend="hf").completion_ids
    assert len(calls) == 6


@pytest.mark.parametrize("state", ["active", "merged", "disabled"])
def test_lora_adapters_are_added_to_the_weights_as_peft_applies_them(state):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                        lora_dropout=0.1))
    with torch.no_grad():  # B starts at zero; random B makes every adapter move the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.eval()
    if state == "merged":
        model.merge_adapter()
    ids, mask = _batch()
    ours = Decoder.for_model(model, ids.shape[1] + 16)
    assert ours is not None
    if state == "disabled":
        with model.disable_adapter():
            tokens, theirs = ours.__class__(model).generate(ids, mask, 16, [1], 0), _hf(model, ids, mask, 16)
    else:
        tokens, theirs = ours.generate(ids, mask, 16, [1], 0), _hf(model, ids, mask, 16)
    assert torch.equal(tokens, theirs)
    base = _hf(_model("qwen2"), ids, mask, 16)
    assert torch.equal(tokens, base) == (state == "disabled")  # the adapters do change the tokens


def test_it_steps_aside_for_what_it_does_not_reproduce():
    import transformers
    from peft import LoraConfig, get_peft_model

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96))
    assert "GPT2LMHeadModel" in why_not(gpt2, 16)
    dora = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert "DoRA" in why_not(dora, 16)
    penalised = _model("llama")
    penalised.generation_config.repetition_penalty = 1.2
    assert "repetition_penalty" in why_not(penalised, 16)
    windowed = _model("mistral", sliding_window=8)
    assert "sliding window" in why_not(windowed, 16) and why_not(windowed, 8) is None
    hooked = _model("llama")
    hooked.model.norm.register_forward_hook(lambda *a: None)
    assert "hooks on model.norm" == why_not(hooked, 16)
    assert why_not(_model("llama").to("meta"), 16) == "parameters on ['meta']: the decoder is for CPU"


def test_it_steps_aside_for_models_larger_than_the_copy_it_makes(monkeypatch):
    import stages.generation.decoder as decoder

    model = _model("llama")
    monkeypatch.setattr(decoder, "MAX_WEIGHT_BYTES", 1000)
    assert "GiB of weights" in why_not(model, 16)


def test_decode_steps_run_on_weights_packed_for_their_row_count(monkeypatch):
    from stages.generation import decoder

    if not decoder.PACKED_LINEAR:
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(decoder, "PACK_MIN_BYTES", 0)  # a tiny model's weights stay in the caches: not packed
    model = _model("qwen2")  # q/k/v biases go through the packed path too
    calls = []
    packed_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(decoder.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: calls.append(x.shape[0]) or packed_linear(x, *a))
    ids, mask = _batch()
    tokens = Decoder(model).generate(ids, mask, 16, [1], 0, n=2)
    assert torch.equal(tokens, _hf(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), 16))
    layers = model.config.num_hidden_layers
    assert calls and set(calls) == {12}  # 6 prompts x 2 rows; the prefill (6 x 12 positions) is not packed
    # one call per group of projections (q/k/v, o, gate/up, down) and the lm-head, per decode step
    assert len(calls) % (4 * layers + 1) == 0 and len(calls) // (4 * layers + 1) == tokens.shape[1] - 1


def test_a_packed_linear_equals_f_linear_and_falls_back_at_other_row_counts():
    from stages.generation.decoder import PACKED_LINEAR, _Linear

    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 24), torch.randn(40), torch.randn(2, 3, 24)
    linear = _Linear([weight], [bias])
    linear.pack(6)
    assert (linear.packed is not None) == PACKED_LINEAR
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias))
    torch.testing.assert_close(linear(x[:1]), F.linear(x[:1], weight, bias))
    bf16 = _Linear([weight.bfloat16()], [None])
    bf16.pack(6)
    assert bf16.packed is None  # fp32 weights only: bf16 ones keep F.linear


def test_a_packed_group_splits_into_each_projection_with_its_own_bias():
    from stages.generation.decoder import _Linear

    torch.manual_seed(0)
    weights, x = [torch.randn(40, 24), torch.randn(8, 24), torch.randn(16, 24)], torch.randn(2, 3, 24)
    biases = [torch.randn(40), None, torch.randn(16)]  # a projection without a bias adds nothing
    group = _Linear(weights, biases)
    expected = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    for rows in (6, 2):  # packed at 6 rows; the 2-row input falls back to F.linear per projection
        group.pack(rows)
        parts = group.parts(x)
        assert [p.shape for p in parts] == [e.shape for e in expected]
        for part, want in zip(parts, expected, strict=True):
            torch.testing.assert_close(part, want)


def test_weights_that_fit_in_the_caches_are_not_packed(monkeypatch):
    from stages.generation import decoder

    calls = []
    monkeypatch.setattr(decoder._Linear, "pack", lambda self, rows: calls.append(rows))
    ids, mask = _batch()
    Decoder(_model("llama")).generate(ids, mask, 4, [1], 0)
    assert calls == []
    monkeypatch.setattr(decoder, "PACK_MIN_BYTES", 0)
    Decoder(_model("llama")).generate(ids, mask, 4, [1], 0)
    assert calls and set(calls) == {6}
