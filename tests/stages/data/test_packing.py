"""Packing: every token kept, sequences intact, positions restart; packed sequences do not attend to each other."""
import time

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.builtin import tiny
from stages.data.collators import CompletionCollator
from stages.data.packing import pack_dataset
from stages.data.tokenize import tokenize_sft
from stages.losses import sft_loss


def rows_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 1000, n).tolist(), "completion_mask": rng.integers(0, 2, n).tolist(),
             "text": f"row {i}"} for i, n in enumerate(lengths)]


def sequences(packed):
    """The (input_ids, completion_mask) pieces of packed rows, cut at seq_lengths."""
    out = []
    for row in packed:
        at = 0
        for n in row["seq_lengths"]:
            out.append((tuple(row["input_ids"][at:at + n]), tuple(row["completion_mask"][at:at + n])))
            at += n
    return out


def test_bfd_exact_small_case():
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [4, 5, 6, 7, 8], "completion_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [9], "completion_mask": [1]},
            {"input_ids": [10, 11], "completion_mask": [0, 1]}]
    # longest first: 5 -> bin A (room 1); 3 -> bin B (room 3); 2 -> B, the only fit (room 1);
    # 1 -> A and B are equally tight: the first opened, A
    assert pack_dataset(rows, 6) == [
        {"input_ids": [4, 5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1, 1],
         "position_ids": [0, 1, 2, 3, 4, 0], "seq_lengths": [5, 1]},
        {"input_ids": [1, 2, 3, 10, 11], "completion_mask": [0, 1, 1, 0, 1],
         "position_ids": [0, 1, 2, 0, 1], "seq_lengths": [3, 2]},
    ]


def test_bfd_keeps_every_token_and_sequence():
    rows = rows_of(np.random.default_rng(1).integers(1, 40, 300))
    packed = pack_dataset(rows, 64)
    assert sorted(sequences(packed)) == sorted((tuple(r["input_ids"]), tuple(r["completion_mask"])) for r in rows)
    for row in packed:
        assert len(row["input_ids"]) == sum(row["seq_lengths"]) <= 64
        assert row["position_ids"] == [p for n in row["seq_lengths"] for p in range(n)]
        assert set(row) == {"input_ids", "completion_mask", "position_ids", "seq_lengths"}  # "text" dropped


def test_bfd_truncates_overflow_only():
    rows = [{"input_ids": list(range(10))}, {"input_ids": [20, 21]}, {"input_ids": []}]
    assert pack_dataset(rows, 4) == [
        {"input_ids": [0, 1, 2, 3], "position_ids": [0, 1, 2, 3], "seq_lengths": [4]},
        {"input_ids": [20, 21], "position_ids": [0, 1], "seq_lengths": [2]},
    ]


def slow_best_fit_loads(lengths, capacity):
    """Obvious best-fit decreasing: scan every bin for the tightest fit. Returns the sorted bin loads."""
    loads = []
    for n in sorted((min(n, capacity) for n in lengths), reverse=True):
        fits = [i for i, load in enumerate(loads) if load + n <= capacity]
        if fits:
            best = min(fits, key=lambda i: capacity - loads[i])
            loads[best] += n
        else:
            loads.append(n)
    return sorted(loads)


@pytest.mark.parametrize("seed, capacity", [(0, 16), (1, 50), (2, 100)])
def test_bfd_matches_the_obvious_best_fit(seed, capacity):
    lengths = np.random.default_rng(seed).integers(1, 60, 500).tolist()
    packed = pack_dataset([{"input_ids": [1] * n} for n in lengths], capacity)
    assert sorted(len(r["input_ids"]) for r in packed) == slow_best_fit_loads(lengths, capacity)


def test_wrapped_cuts_exact_chunks_and_restarts_positions():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}, {"input_ids": [9]}]
    assert pack_dataset(rows, 4, "wrapped") == [
        {"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 2, 0], "seq_lengths": [3, 1]},
        {"input_ids": [5, 6, 7, 8], "position_ids": [0, 1, 2, 3], "seq_lengths": [4]},
        {"input_ids": [9], "position_ids": [0], "seq_lengths": [1]},
    ]


def test_dataset_in_dataset_out_same_rows_as_lists():
    rows = rows_of([5, 17, 3, 30, 12, 8])
    ds = datasets.Dataset.from_list(rows).shuffle(seed=0)  # an indices mapping must be honoured
    for strategy in ("bfd", "wrapped"):
        out = pack_dataset(ds, 32, strategy)
        assert isinstance(out, datasets.Dataset)
        assert out.to_list() == pack_dataset(ds.to_list(), 32, strategy)


def test_unknown_strategy_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"packing strategy 'ffd' is not supported; use one of: bfd, wrapped"):
        pack_dataset([{"input_ids": [1]}], 8, "ffd")


def test_rows_without_input_ids_are_refused():
    with pytest.raises(ValueError, match=r"needs tokenised rows with an 'input_ids' column; found \['text'\]"):
        pack_dataset(datasets.Dataset.from_list([{"text": "hi"}]), 8)


def test_packs_100k_rows_in_seconds():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, 100_000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 30_000, int(lengths.sum()))
    ds = datasets.Dataset(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))}))
    start = time.perf_counter()
    out = pack_dataset(ds, 1024)
    elapsed = time.perf_counter() - start
    assert elapsed < 15, f"packing 100k rows took {elapsed:.1f}s"
    table = out.with_format("arrow")[:]
    flat = table.column("input_ids").combine_chunks().flatten().to_numpy()
    assert np.array_equal(np.sort(flat), np.sort(values))  # every token kept
    assert table.column("seq_lengths").combine_chunks().flatten().to_numpy().sum() == lengths.sum()
    assert len(out) == int(np.ceil(lengths.sum() / 1024))  # short items: best fit leaves no bin half empty


# ---- packed sequences are independent in a real model ------------------------------------------------

CONVERSATIONS = [
    ("2+2?", "4"), ("What is 17 times 3? Think step by step.", "17*3 = 51. The answer is 51."),
    ("Say hi", "hi"), ("Count to five", "1 2 3 4 5"), ("12-5?", "7"),
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, vocab_size=384, seed=0)


@pytest.fixture(scope="module")
def examples(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in CONVERSATIONS]
    return tok.pad_token_id, tokenize_sft(tok, rows)


def summed_loss(model, batch, **kwargs):
    """(sum of token losses, number of labelled tokens) of one collated batch."""
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch, **kwargs).logits
    loss, stats = sft_loss(logits, labels)
    return loss.double() * stats["num_tokens"], int(stats["num_tokens"])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_loss_equals_the_separate_losses(tiny_model_dir, examples, attn):
    """sum over packed tokens of -log p == sum over each example alone: no attention across sequences.

    transformers finds the sequence starts in position_ids when there is no 2D attention mask
    and no KV cache (use_cache=False), and builds a block-diagonal causal mask from them.
    """
    from transformers import AutoModelForCausalLM

    pad, features = examples
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    collate = CompletionCollator(pad)
    separate = [summed_loss(model, collate([f]), use_cache=False) for f in features]
    expected_sum, expected_tokens = sum(s for s, _ in separate), sum(n for _, n in separate)

    free = CompletionCollator(pad, padding_free=True)(features)  # one row (1, total), no padding
    assert free["input_ids"].shape == (1, sum(len(f["input_ids"]) for f in features))
    got_sum, got_tokens = summed_loss(model, dict(free), use_cache=False)
    assert got_tokens == expected_tokens
    assert got_sum.item() == pytest.approx(expected_sum.item(), rel=1e-5)

    packed_rows = pack_dataset(features, 64)  # several rows, some holding several sequences
    assert len(packed_rows) > 1 and any(len(r["seq_lengths"]) > 1 for r in packed_rows)
    padded = collate(packed_rows)
    got_sum, got_tokens = summed_loss(model, padded, use_cache=False)
    assert got_tokens == expected_tokens
    assert got_sum.item() == pytest.approx(expected_sum.item(), rel=1e-5)

    # the controls: without the restarting positions, or with a KV cache (the default use_cache=True),
    # transformers sees one long sequence and the later examples attend to the earlier ones
    plain = dict(free, position_ids=torch.arange(free["input_ids"].shape[1])[None])
    assert abs(summed_loss(model, plain, use_cache=False)[0].item() - expected_sum.item()) > 1e-3
    assert abs(summed_loss(model, dict(free))[0].item() - expected_sum.item()) > 1e-3
