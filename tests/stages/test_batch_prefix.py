"""Rows that start with the same tokens run them once (stages.batch_prefix): the pairs' log-probs and gradients equal
the whole forward's on several architectures; where it does not apply (too few shared tokens, a token read inside
them, activation checkpointing, a model that ignores the cache) the whole forward runs."""
import logging

import pytest
import torch

from stages import batch_prefix
from stages.logprobs import causal_lm
from stages.pair_packing import pack_pairs
from stages.trainers.pair_batches import PairCollator, sequence_logps, tokenize_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows

INSTRUCTION = "You are a careful calculator. Work it out step by step, then give the number. "


def _rows(n: int = 4) -> list[dict]:
    """Plain-text pairs (GPT-2 has no chat template) whose prompts all start with INSTRUCTION."""
    return [{"prompt": INSTRUCTION + r["prompt"][0]["content"], "chosen": r["chosen"][0]["content"],
             "rejected": r["rejected"][0]["content"]}
            for r in builtin_rows("preference", "preference", num_preference=n)]


def _models(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests import architectures

    yield "llama", AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "llama", num_layers=2))
    yield "llama-eager", AutoModelForCausalLM.from_pretrained(tmp_path / "llama", attn_implementation="eager")
    for arch in ("qwen2", "gpt2", "mistral"):
        yield arch, AutoModelForCausalLM.from_pretrained(getattr(architectures, arch)(tmp_path / arch))


class _Runs:
    """The shared lengths of the shared-prefix forwards that ran for `sequence_logps`."""

    def __init__(self, monkeypatch):
        from stages.trainers import pair_batches

        self.lengths: list[int] = []
        shared_length = batch_prefix.shared_length

        def prefix_hidden(lm, inputs, first_read):
            out = batch_prefix.prefix_hidden(lm, inputs, first_read)
            if out is not None:
                self.lengths.append(shared_length(lm, inputs, first_read))
            return out

        monkeypatch.setattr(pair_batches, "prefix_hidden", prefix_hidden)


def _logps_and_grads(model, batch):
    model.zero_grad()
    logps = sequence_logps(model, batch, pairs=True)
    (logps * torch.linspace(1, 2, logps.shape[0])).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_shared_first_tokens_run_once_with_the_whole_forwards_logps_and_gradients(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    runs = _Runs(monkeypatch)
    for arch, model in _models(tmp_path):
        tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
        model.train()
        for module in model.modules():  # GPT-2's dropout would make two forwards differ
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, _rows(), 256))
        instruction = len(tok(INSTRUCTION)["input_ids"])
        runs.lengths.clear()
        shared = _logps_and_grads(model, batch)
        assert len(runs.lengths) == 1 and runs.lengths[0] >= instruction - 2, arch  # BPE may merge its last token
        monkeypatch.setattr(batch_prefix, "MIN_TOKENS", 10**6)
        whole = _logps_and_grads(model, batch)
        monkeypatch.undo()
        runs = _Runs(monkeypatch)
        assert not runs.lengths
        torch.testing.assert_close(shared[0], whole[0], rtol=1e-5, atol=1e-4, msg=arch)
        for name in whole[1]:
            torch.testing.assert_close(shared[1][name], whole[1][name], rtol=1e-4, atol=1e-5, msg=f"{arch} {name}")


def _packed_inputs(tmp_path, rows):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "m", num_layers=2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, rows, 256))
    lm = causal_lm(model)
    packed = pack_pairs(lm, batch)
    assert packed is not None
    return model, lm, packed.inputs(lm), batch, len(tok(INSTRUCTION)["input_ids"])


def test_the_shared_length_stops_where_a_row_differs_or_a_hidden_state_is_read(tmp_path):
    model, lm, inputs, _, instruction = _packed_inputs(tmp_path, _rows())
    length = batch_prefix.shared_length(lm, inputs, first_read=10**6)
    assert instruction - 2 <= length < instruction + 8  # the instruction, and what the questions share after it
    assert batch_prefix.shared_length(lm, inputs, first_read=5) == 5
    other = {**inputs, "input_ids": inputs["input_ids"].clone()}
    other["input_ids"][1, 3] += 1
    assert batch_prefix.shared_length(lm, other, first_read=10**6) == 3
    shifted = {**inputs, "position_ids": inputs["position_ids"] + 1}
    assert batch_prefix.shared_length(lm, shifted, first_read=10**6) == 0
    blind = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
    blind["attention_mask"][0, 0, 4, 2] = False  # a shared token that does not see one before it
    assert batch_prefix.shared_length(lm, blind, first_read=10**6) == 0
    one_row = {key: value[:1] for key, value in inputs.items()}
    assert batch_prefix.shared_length(lm, one_row, first_read=10**6) == 0
    model.gradient_checkpointing_enable()
    model.train()
    assert batch_prefix.shared_length(causal_lm(model), inputs, first_read=10**6) == 0  # it turns the cache off


def test_a_model_that_ignores_the_cache_runs_its_rows_whole(tmp_path, caplog, monkeypatch):
    """A forward that drops the cache (as some remote-code models do) gives the wrong hidden states on a shared
    prefix: the first-use check finds it, says so by name, and the log-probs are the whole forward's."""
    model, lm, inputs, batch, _ = _packed_inputs(tmp_path, _rows())
    model.eval()
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(batch_prefix, "MIN_TOKENS", 10**6)
        whole = sequence_logps(model, batch, pairs=True)
    inner_forward = model.model.forward

    def ignoring(*args, cache=None, **kwargs):
        return inner_forward(*args, **kwargs)

    model.model.forward = ignoring
    runs = _Runs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=batch_prefix.__name__), torch.no_grad():
        got = sequence_logps(model, batch, pairs=True)
    assert "shared prefixes are off for LlamaForCausalLM" in caplog.text and not runs.lengths
    torch.testing.assert_close(got, whole)
    assert batch_prefix.prefix_hidden(lm, inputs, 10**6) is None  # remembered: checked once per model
