"""Mismatched completions run from the matched rows' cached prompts give their padded rows' log-probs, and the
matched rows' log-probs and gradients are the padded ones, on several architectures; a model whose cached
continuation differs is found by the first-use check and keeps the other path."""
import logging

import pytest
import torch

from stages import prompt_cache
from stages.logprobs import causal_lm
from stages.prompt_cache import continued_logps, shared_prompt_lengths
from stages.trainers.kto_trainer import KL_PREFIX, KTOCollator, _part, tokenize_unpaired
from stages.trainers.pair_batches import sequence_logps
from tests.stages.test_pair_packing import _models
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def _rows(n: int = 6) -> list[dict]:
    return [{"prompt": r["prompt"][0]["content"], "completion": r["completion"][0]["content"], "label": r["label"]}
            for r in builtin_rows("unpaired", "unpaired", num_preference=2 * n)[:n]]  # plain text: GPT-2 too


def _batch(tok, rows) -> dict[str, torch.Tensor]:
    return KTOCollator(tok.pad_token_id, 256)(tokenize_unpaired(tok, rows, 256))


def _no_dropout(model):
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0  # GPT-2
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_cached_continuations_equal_the_padded_rows_on_every_architecture(tmp_path):
    from transformers import AutoTokenizer

    rows = _rows()
    for arch, model in _models(tmp_path):
        tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
        model = _no_dropout(model)
        batch = _batch(tok, rows)
        matched, mismatched = _part(batch, ""), _part(batch, KL_PREFIX)
        model.zero_grad()
        expected = sequence_logps(model, matched)
        (expected * torch.linspace(1, 2, expected.shape[0])).sum().backward()
        g_expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            expected_kl = sequence_logps(model, mismatched)
        model.zero_grad()
        got = continued_logps(model, matched, mismatched)
        if causal_lm(model).head is None:  # Gemma 2 soft-caps its logits: no chunked head, the other path
            assert got is None, arch
            continue
        assert got is not None, arch
        logps, kl = got
        assert not kl.requires_grad, arch
        (logps * torch.linspace(1, 2, logps.shape[0])).sum().backward()
        torch.testing.assert_close(logps.detach(), expected.detach(), rtol=1e-5, atol=1e-4, msg=arch)
        torch.testing.assert_close(kl, expected_kl, rtol=1e-5, atol=1e-4, msg=arch)
        for name, grad in g_expected.items():
            torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-5,
                                       msg=f"{arch} {name}")


def test_rows_that_do_not_share_their_prompts_are_refused(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny(tmp_path / "m"))
    batch = _batch(tok, _rows(4))
    matched, mismatched = _part(batch, ""), _part(batch, KL_PREFIX)
    assert shared_prompt_lengths(matched, mismatched).tolist() == \
        (matched["completion_mask"].int().argmax(-1)).tolist()
    other = {**mismatched, "input_ids": mismatched["input_ids"].roll(1, dims=0)}  # another row's prompt
    assert shared_prompt_lengths(matched, other) is None
    left = {k: v.flip(-1) for k, v in matched.items()}  # left padding
    assert shared_prompt_lengths(left, mismatched) is None


def test_a_model_whose_cached_continuation_differs_keeps_the_other_path(tmp_path, caplog, monkeypatch):
    """A continuation that does not reproduce the padded forward (here: one that drops the cache, as a forward
    that ignores it would) is found by the first-use check, said by name, and remembered."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    real = prompt_cache.continuation_hidden
    monkeypatch.setattr(prompt_cache, "continuation_hidden",
                        lambda lm, module, cache, *a: real(lm, module, type(cache)(), *a))
    batch = _batch(tok, _rows(4))
    with caplog.at_level(logging.WARNING, logger=prompt_cache.__name__):
        assert continued_logps(model, _part(batch, ""), _part(batch, KL_PREFIX)) is None
    assert "cached continuations are off for LlamaForCausalLM" in caplog.text
    caplog.clear()
    assert continued_logps(model, _part(batch, ""), _part(batch, KL_PREFIX)) is None  # remembered
    assert caplog.text == ""


def test_without_a_cache_the_mismatched_rows_run_padded(tmp_path):
    """Activation checkpointing turns the cache off: the same values come from a padded forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = _no_dropout(AutoModelForCausalLM.from_pretrained(path))
    batch = _batch(tok, _rows(4))
    matched, mismatched = _part(batch, ""), _part(batch, KL_PREFIX)
    assert continued_logps(model, matched, mismatched) is not None  # checked with the cache first
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with torch.no_grad():
        expected = sequence_logps(model, mismatched)
    got = continued_logps(model, matched, mismatched)
    assert got is not None
    torch.testing.assert_close(got[1], expected, rtol=1e-5, atol=1e-4)
