"""Tokenising through `Dataset.map` (stages.data.tokenize.tokenized_dataset) against the obvious version: the
row-list functions over all rows at once, then `Dataset.from_list`. Batches, worker processes and the Arrow cache
change nothing but speed and memory; the cache key follows the tokenizer's content, not its path."""
from __future__ import annotations

from functools import partial

import datasets
import pytest

from stages.data.tokenize import tokenize_sft, tokenized_dataset, tokenizer_fingerprint
from stages.trainers.kto_trainer import tokenize_unpaired, with_kl_pairs
from stages.trainers.pair_batches import tokenize_pairs
from stages.trainers.reward_trainer import tokenize_pairs as reward_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


def _sft(tok, rows, *, start=0, max_length=64):
    return tokenize_sft(tok, rows, max_length=max_length)


@pytest.mark.parametrize("num_proc", [None, 2])
def test_mapped_batches_equal_the_whole_list_tokenised_at_once(tok, num_proc):
    sft = builtin_rows("sft", "messages", num_train=250)
    pairs = builtin_rows("preference", "preference", num_preference=90)
    unpaired = builtin_rows("unpaired", "unpaired", num_preference=90)
    cases = [(sft, partial(_sft, tok), _sft(tok, sft), "input_ids"),
             (pairs, partial(tokenize_pairs, tok, max_length=64), tokenize_pairs(tok, pairs, 64), "chosen_input_ids"),
             (pairs, partial(reward_pairs, tok, max_length=64), reward_pairs(tok, pairs, 64), "chosen_input_ids")]
    for rows, fn, whole, marker in cases:
        mapped = tokenized_dataset(rows, fn, marker=marker, tokenizer=tok, num_proc=num_proc, batch_size=32)
        assert mapped.to_list() == datasets.Dataset.from_list(whole).to_list()
        assert mapped.features == datasets.Dataset.from_list(whole).features
    kto = with_kl_pairs(tokenized_dataset(unpaired, partial(tokenize_unpaired, tok, max_length=64, kl=False),
                                          marker="prompt_ids", tokenizer=tok, num_proc=num_proc, batch_size=32))
    assert kto.to_list() == tokenize_unpaired(tok, unpaired, 64)  # the KL pairs roll over the whole dataset


def test_a_dataset_and_a_streamed_dataset_give_the_same_tokens(tok):
    sft = builtin_rows("sft", "messages", num_train=100)
    whole = _sft(tok, sft)
    as_dataset = tokenized_dataset(datasets.Dataset.from_list(sft), partial(_sft, tok), marker="input_ids",
                                   tokenizer=tok, batch_size=16)
    assert as_dataset.to_list() == whole
    streamed = tokenized_dataset(datasets.Dataset.from_list(sft).to_iterable_dataset(), partial(_sft, tok),
                                 marker="input_ids", tokenizer=tok, batch_size=16)
    assert isinstance(streamed, datasets.IterableDataset) and list(streamed) == whole


def test_the_cache_is_reused_for_the_same_tokens_only(tok, tmp_path):
    sft = builtin_rows("sft", "messages", num_train=60)
    first = tokenized_dataset(sft, partial(_sft, tok), marker="input_ids", tokenizer=tok)
    files = [f["filename"] for f in first.cache_files]
    assert files and all(f.startswith(str(tmp_path / "cache" / "align-tokenized")) for f in files)
    again = tokenized_dataset([dict(r) for r in sft], partial(_sft, tok), marker="input_ids", tokenizer=tok)
    assert [f["filename"] for f in again.cache_files] == files  # the same rows and tokenizer: read back

    other = tok.__class__.from_pretrained(tok.name_or_path)  # same path, another chat template
    other.chat_template = tok.chat_template.replace("'|>\n'", "'|>\n\n'")  # a blank line after the role
    assert other.chat_template != tok.chat_template
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    changed = tokenized_dataset(sft, partial(_sft, other), marker="input_ids", tokenizer=other)
    assert [f["filename"] for f in changed.cache_files] != files
    assert changed.to_list() == _sft(other, sft) != first.to_list()

    longer = tokenized_dataset(sft, partial(_sft, tok, max_length=8), marker="input_ids", tokenizer=tok)
    assert [f["filename"] for f in longer.cache_files] != files  # the closure's max_length is in the key
    assert max(len(r["input_ids"]) for r in longer.to_list()) == 8


def test_messages_name_the_row_in_the_whole_dataset(tok):
    pairs = builtin_rows("preference", "preference", num_preference=80)
    pairs[70] = {**pairs[70], "rejected": pairs[70]["chosen"]}
    with pytest.raises(ValueError, match=r"first: row 70\)"):
        tokenized_dataset(pairs, partial(tokenize_pairs, tok, max_length=64), marker="chosen_input_ids",
                          tokenizer=tok, batch_size=32)
    with pytest.raises(ValueError, match=r"preference row 70 has identical chosen and rejected"):
        tokenized_dataset(pairs, partial(reward_pairs, tok, max_length=64), marker="chosen_input_ids",
                          tokenizer=tok, batch_size=32)


def test_already_tokenised_rows_pass_through(tok):
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}]
    assert tokenized_dataset(rows, partial(_sft, tok), marker="input_ids", tokenizer=tok).to_list() == rows
    assert tokenized_dataset(None, partial(_sft, tok), marker="input_ids", tokenizer=tok) is None
