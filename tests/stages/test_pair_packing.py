"""Pairs packed on their shared prefix give the padded rows' log-probs, rewards and gradients, on several
architectures; a model that ignores the packed layout is found by the first-use check and keeps the padded rows."""
import logging

import pytest
import torch

from stages import pair_packing
from stages.logprobs import causal_lm
from stages.pair_packing import layout, pack_pairs
from stages.tensors import pad
from stages.trainers.pair_batches import PairCollator, sequence_logps, tokenize_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def _batch(pairs: list[tuple[list[int], list[int], int]]) -> dict[str, torch.Tensor]:
    """(chosen ids, rejected ids, prompt length) per pair -> a PairCollator-shaped batch."""
    ids = [torch.tensor(c) for c, _, _ in pairs] + [torch.tensor(r) for _, r, _ in pairs]
    prompt = [p for _, _, p in pairs] * 2
    masks = [torch.tensor([0] * p + [1] * (len(i) - p)) for i, p in zip(ids, prompt, strict=True)]
    return {"input_ids": pad(ids, padding_value=0), "attention_mask": pad([torch.ones_like(i) for i in ids]),
            "completion_mask": pad(masks)}


def test_layout_puts_the_rejected_suffix_after_the_chosen_one_and_hides_it():
    # pair 0 shares [5, 6, 7] (prompt 5, 6 and the completion's first token); pair 1 only its prompt
    b = _batch([([5, 6, 7, 8, 9], [5, 6, 7, 3], 2), ([4, 1, 2], [4, 2, 2, 2], 1)])
    p = layout(b["input_ids"], b["attention_mask"])
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 3], [4, 1, 2, 2, 2, 2]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 1, 2, 3]]
    m = p.mask[0, 0]
    assert m[5].tolist() == [True, True, True, False, False, True]  # rejected 3: the prefix and itself
    assert m[4].tolist() == [True, True, True, True, True, False]   # chosen 9: causal, no rejected token
    m = p.mask[1, 0]
    assert m[3].tolist() == [True, False, False, True, False, False]
    assert m[5].tolist() == [True, False, False, True, True, True]
    # back to 2B padded rows: the rejected rows read the prefix's positions, then their own
    assert p.unpack(p.input_ids)[2, :4].tolist() == [5, 6, 7, 3] \
        and p.unpack(p.input_ids)[3, :4].tolist() == [4, 2, 2, 2]
    assert torch.equal(p.unpack(p.input_ids) * b["attention_mask"], b["input_ids"])


def test_layout_refuses_left_padding_and_odd_rows():
    b = _batch([([5, 6, 7, 8], [5, 6, 3], 2)])
    assert layout(b["input_ids"].flip(-1), b["attention_mask"].flip(-1)) is None
    assert layout(b["input_ids"][:1], b["attention_mask"][:1]) is None


def _models(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests import architectures

    yield "llama", AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "llama", num_layers=2))
    yield "llama-eager", AutoModelForCausalLM.from_pretrained(tmp_path / "llama", attn_implementation="eager")
    for arch in ("qwen2", "gpt2", "gemma2", "mistral"):
        yield arch, AutoModelForCausalLM.from_pretrained(getattr(architectures, arch)(tmp_path / arch))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_packed_logps_and_gradients_equal_the_padded_rows_on_every_architecture(tmp_path):
    rows = [{k: r[k][0]["content"] for k in ("prompt", "chosen", "rejected")}  # plain text: GPT-2 has no template
            for r in builtin_rows("preference", "preference", num_preference=8)]
    for arch, model in _models(tmp_path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
        model.train()
        model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0  # GPT-2
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, rows, 128))
        packed = pack_pairs(causal_lm(model), batch)
        assert packed is not None, arch
        assert packed.tokens < 0.75 * batch["input_ids"].numel(), arch  # the built-in pairs share most tokens
        results = []
        for pairs in (False, True):
            model.zero_grad()
            logps = sequence_logps(model, batch, pairs=pairs)
            (logps * torch.linspace(1, 2, logps.shape[0])).sum().backward()
            results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (padded, g_padded), (packed_logps, g_packed) = results
        torch.testing.assert_close(packed_logps, padded, rtol=1e-5, atol=1e-4, msg=arch)
        for name in g_padded:
            torch.testing.assert_close(g_packed[name], g_padded[name], rtol=1e-4, atol=1e-5, msg=f"{arch} {name}")


def test_packed_rewards_and_gradients_equal_the_padded_rows(tmp_path):
    from transformers import AutoTokenizer

    from stages.reward_model import load_reward_model, sequence_rewards
    from stages.trainers.reward_trainer import RewardCollator
    from stages.trainers.reward_trainer import tokenize_pairs as reward_pairs

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = load_reward_model(str(path)).train()
    batch = RewardCollator(tok.pad_token_id)(reward_pairs(tok, builtin_rows("preference", "preference",
                                                                          num_preference=6), 128))
    assert pack_pairs(causal_lm(model), batch) is not None
    results = []
    for pairs in (False, True):
        model.zero_grad()
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], pairs=pairs)
        (rewards * torch.arange(1, rewards.shape[0] + 1)).sum().backward()
        results.append((rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_that_ignores_the_packed_mask_keeps_the_padded_rows(tmp_path, caplog):
    """A forward that drops position_ids and the 4D mask (as some remote-code models do) gives the wrong
    hidden states packed: the first-use check finds it, says so by name, and the padded rows are used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    inner_forward = model.model.forward

    def ignoring(*args, position_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return inner_forward(*args, **kwargs, attention_mask=attention_mask)

    model.model.forward = ignoring
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, builtin_rows("preference", "preference",
                                                                           num_preference=4), 128))
    with caplog.at_level(logging.WARNING, logger=pair_packing.__name__):
        assert pack_pairs(causal_lm(model), batch) is None
    assert "packing is off for LlamaForCausalLM" in caplog.text
    assert pack_pairs(causal_lm(model), batch) is None  # remembered: checked once per model


def test_no_packing_when_it_saves_little(tmp_path):
    """Pairs with nothing in common and equal lengths would pack to twice the width: the padded rows stay."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "m"))
    batch = _batch([([5, 6, 7, 8], [9, 10, 11, 12], 0), ([13, 14, 15], [16, 17, 18], 0)])
    assert pack_pairs(causal_lm(model), batch) is None
    assert sequence_logps(model, batch, pairs=True).shape == (4,)


def test_packing_is_kept_under_bf16_autocast(tmp_path):
    """bf16 rounding is far inside the first-use check's tolerance: the packed rows are used, and the log-probs
    agree with the padded ones as closely as two bf16 forwards can."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.precision import autocast_forward

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, builtin_rows("preference", "preference",
                                                                           num_preference=8), 128))
    with autocast_forward(model, "bf16"):
        assert pack_pairs(causal_lm(model), batch) is not None
        packed, padded = sequence_logps(model, batch, pairs=True), sequence_logps(model, batch)
    torch.testing.assert_close(packed, padded, rtol=2e-2, atol=0.1)


def test_joined_is_one_row_without_padding_and_keeps_the_pairs_apart():
    """The layout test's two pairs (packed widths 6 and 6) joined: 12 tokens in one row, positions restarting at the
    second pair, a block-diagonal mask, and unpacking gives the 2B padded rows back."""
    b = _batch([([5, 6, 7, 8, 9], [5, 6, 7, 3], 2), ([4, 1, 2], [4, 2, 2, 2], 1)])
    p = layout(b["input_ids"], b["attention_mask"]).joined()
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 4, 1, 2, 2, 2, 2]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 1, 2, 3]]
    m = p.mask[0, 0]
    assert m[5].tolist() == [True, True, True, False, False, True] + [False] * 6
    assert m[11].tolist() == [False] * 6 + [True, False, False, True, True, True]  # never the first pair
    assert torch.equal(p.unpack(p.input_ids) * b["attention_mask"], b["input_ids"])


def _tokens_once(batch) -> int:
    """The real tokens of a PairCollator batch with each pair's shared prefix counted once (a plain loop)."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    b, total = len(rows) // 2, 0
    for chosen, rejected in zip(rows[:b], rows[b:], strict=True):
        # strict=False: the common prefix ends where the shorter row does
        shared = next((i for i, (c, r) in enumerate(zip(chosen, rejected, strict=False)) if c != r),
                      min(len(chosen), len(rejected)))
        total += len(chosen) + len(rejected) - shared
    return total


def test_padding_free_logps_and_gradients_equal_the_padded_rows(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, builtin_rows("preference", "preference",
                                                                           num_preference=6), 128))
    results = []
    for free in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path)
        seen: list = []
        model.register_forward_pre_hook(lambda m, a, kw, seen=seen: seen.append(kw["input_ids"].shape),
                                        with_kwargs=True)
        logps = sequence_logps(model, batch, pairs=False, padding_free=free)
        logps.sum().backward()
        results.append((logps.detach(), model.model.embed_tokens.weight.grad))
        if free:  # the training forward (after the first-use check's): one row of the pairs' tokens, no padding
            assert seen[-1] == torch.Size([1, _tokens_once(batch)]) and len(seen) <= 3
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-3)


def test_padding_free_says_why_a_model_cannot_run_it(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "m"))
    model.config._attn_implementation = "flash_attention_2"  # what a flash model reports (not loadable on CPU)
    batch = _batch([([5, 6, 7, 8], [5, 6, 3], 2)])
    with pytest.raises(ValueError, match=r"padding_free = True: LlamaForCausalLM cannot run a batch as one row "
                                         r"without padding: its attention is 'flash_attention_2'.*set padding_free: "
                                         r"false"):
        sequence_logps(model, batch, padding_free=True)
