"""stages.completion_text: generated ids to the strings reward functions see, on real (locally trained) tokenizers."""

from __future__ import annotations

import pytest
import torch

from stages.completion_text import Completion, clean_decoded_text, decode_and_strip_padding, parse_completions
from stages.tensors import completion_mask_from_eos

T = torch.tensor


# ------------------------------------------------------------------ real tokenizer


SPECIALS = ["<|pad|>", "<|end|>", "<think>", "</think>", "<|assistant|>"]
# "€" and "é" never appear in the corpus, so they stay split into byte tokens.
CORPUS = ["The answer is 42.", "let me think about the question", "hello world", "price 3 dollars", "cafe"] * 3


def _tokenizer_object(with_decoder: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if with_decoder:
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _wrap(tok, pad_token="<|pad|>"):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad_token,
        eos_token="<|end|>",
        additional_special_tokens=["<think>", "</think>", "<|assistant|>"],
    )


@pytest.fixture(scope="module")
def tokenizers():
    tok = _tokenizer_object()
    from tokenizers import Tokenizer

    return {
        "pad": _wrap(tok),
        "pad=eos": _wrap(Tokenizer.from_str(tok.to_str()), pad_token="<|end|>"),
        "no-decoder": _wrap(_tokenizer_object(with_decoder=False)),
    }


def _batch(tokenizer, pieces: list[list]) -> torch.Tensor:
    """Rows from pieces: str (encoded), "EOS", or int ids; right-padded with the pad id."""
    rows = []
    for row in pieces:
        ids = []
        for piece in row:
            if piece == "EOS":
                ids.append(tokenizer.eos_token_id)
            elif isinstance(piece, str):
                ids.extend(tokenizer.encode(piece, add_special_tokens=False))
            else:
                ids.extend(piece)
        rows.append(ids)
    width = max(map(len, rows)) + 2  # always some padding
    return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def _cut(tokenizer, text: str, drop: int) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[:-drop]


# (name, pieces, tokenizer key, kwargs, expected Completion)
CASES = [
    ("no-block", ["The answer is 42", "EOS"], "pad", {}, Completion("The answer is 42", None, True)),
    ("complete-block", ["<think>let me think</think> The answer is 42", "EOS"], "pad", {},
     Completion("The answer is 42", "let me think", True)),
    ("open-tag-in-prompt", ["let me think</think>\n42", "EOS"], "pad", {}, Completion("42", "let me think", True)),
    ("open-tag-in-prompt-flag", ["let me think</think>42", "EOS"], "pad", dict(thinking_in_prompt=True),
     Completion("42", "let me think", True)),
    ("incomplete-block", ["<think>let me think about the"], "pad", {}, Completion("", "let me think about the", False)),
    ("incomplete-prompt-opened", ["let me think about"], "pad", dict(thinking_in_prompt=True),
     Completion("", "let me think about", False)),
    ("several-blocks", ["<think>hello</think>world<think>the question</think> 42", "EOS"], "pad", {},
     Completion("42", "hello\nworld\nthe question", True)),
    ("reopened-block", ["<think>hello</think>world<think>the question"], "pad", {},
     Completion("", "hello\nworld\nthe question", False)),
    ("reopened-then-eos", ["<think>hello</think>world<think>the question", "EOS"], "pad", {},
     Completion("", "hello\nworld\nthe question", False)),
    ("pad-equals-eos", ["hello world", "EOS"], "pad=eos", {}, Completion("hello world", None, True)),
    ("pad-equals-eos-block", ["<think>hi</think>hello", "EOS"], "pad=eos", {}, Completion("hello", "hi", True)),
    ("after-first-eos-ignored", ["The answer is 42", "EOS", "<think>hello world"], "pad", {},
     Completion("The answer is 42", None, True)),
    ("no-eos-length-cut", ["hello world"], "pad", {}, Completion("hello world", None, False)),
    ("chat-special-removed", ["<|assistant|>hello world", "EOS"], "pad", {}, Completion("hello world", None, True)),
    ("multibyte-euro-cut", [None], "pad", {}, Completion("price 3", None, False)),
    ("multibyte-e-acute-cut", [None], "pad", {}, Completion("caf", None, False)),
    ("multibyte-intact", ["café 3€", "EOS"], "pad", {}, Completion("café 3€", None, True)),
    ("no-decoder-bytelevel-markers", ["<think>x y</think> café 3€", "EOS"], "no-decoder", {},
     Completion("café 3€", "x y", True)),
    ("no-decoder-cut", [None], "no-decoder", {}, Completion("price 3", None, False)),
    # without block parsing the tags are ordinary special tokens and are removed
    ("think-tags-disabled", ["<think>hi</think> hello", "EOS"], "pad", dict(think_tags=None),
     Completion("hi hello", None, True)),
]


@pytest.mark.parametrize(("name", "pieces", "tok_key", "kwargs", "expected"), CASES, ids=[c[0] for c in CASES])
def test_parse_completions_shapes(tokenizers, name, pieces, tok_key, kwargs, expected):
    tokenizer = tokenizers[tok_key]
    if name.startswith("multibyte-euro") or name == "no-decoder-cut":
        pieces = [_cut(tokenizer, "price 3€", 1)]  # "€" is 3 byte tokens: keep 2 of them
    elif name.startswith("multibyte-e-acute"):
        pieces = [_cut(tokenizer, "café", 1)]  # "é" is 2 byte tokens: keep the first
    # batch the case with a different-length row so padding is really exercised
    if kwargs.get("thinking_in_prompt"):
        other, other_expected = ["x</think>hello", "EOS"], Completion("hello", "x", True)
    else:
        other, other_expected = ["hello", "EOS"], Completion("hello", None, True)
    ids = _batch(tokenizer, [pieces, other])
    if tok_key == "pad=eos":
        assert tokenizer.pad_token_id == tokenizer.eos_token_id
    got = parse_completions(ids, tokenizer, **kwargs)
    assert got[0] == expected
    assert got[1] == other_expected
    assert decode_and_strip_padding(ids, tokenizer, **kwargs) == [expected.answer, "hello"]


def test_think_tags_are_special_tokens(tokenizers):
    tokenizer = tokenizers["pad"]
    ids = tokenizer.encode("<think>a</think>b", add_special_tokens=False)
    # the premise of the policy: skip_special_tokens=True would erase the tags
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    assert decode_and_strip_padding(torch.tensor([ids + [tokenizer.eos_token_id]]), tokenizer) == ["b"]


def test_parse_completions_with_mask_and_lists(tokenizers):
    tokenizer = tokenizers["pad=eos"]
    ids = _batch(tokenizer, [["hello world", "EOS"], ["The answer is 42", "EOS"]])
    mask = completion_mask_from_eos(ids, tokenizer.eos_token_id)
    mask[1, 3:] = 0  # caller-provided mask: only the first 3 tokens of row 1 count
    got = parse_completions(ids.tolist(), tokenizer, mask=mask.tolist())
    assert got[0] == Completion("hello world", None, True)
    expected = tokenizer.decode(ids[1, :3].tolist()).strip()
    assert got[1] == Completion(expected, None, False) and expected != "The answer is 42"


def test_parse_completions_extra_eos_ids(tokenizers):
    tokenizer = tokenizers["pad"]
    stop = tokenizer.convert_tokens_to_ids("<|assistant|>")
    ids = _batch(tokenizer, [["hello", [stop], "world", "EOS"]])
    assert parse_completions(ids, tokenizer, eos_token_id=[tokenizer.eos_token_id, stop]) == [
        Completion("hello", None, True)
    ]


def test_decode_bad_input(tokenizers):
    tokenizer = tokenizers["pad"]
    ids = _batch(tokenizer, [["hello", "EOS"]])
    with pytest.raises(ValueError, match=r"`mask` must have the shape of token_ids \(1, 4\)"):
        decode_and_strip_padding(ids, tokenizer, mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"`token_ids` must be a \(B, T\) integer tensor"):
        decode_and_strip_padding(ids[0], tokenizer)
    with pytest.raises(ValueError, match=r"`token_ids` must be a \(B, T\) integer tensor"):
        decode_and_strip_padding(ids.float(), tokenizer)

    class NoPad:
        pad_token_id = None
        eos_token_id = 1

    with pytest.raises(ValueError, match="`tokenizer` has no pad_token_id"):
        decode_and_strip_padding(ids, NoPad())


@pytest.mark.parametrize(
    ("text", "kwargs", "expected"),
    [
        ("▁Hello▁world", dict(replace_markers=True), "Hello world"),
        ("ĠHelloĠworldĊok", dict(replace_markers=True), "Hello world\nok"),
        ("  answer 42 \n", {}, "answer 42"),
        ("price 3\ufffd\ufffd", {}, "price 3"),
        ("a\ufffdb", {}, "a\ufffdb"),  # a replacement char inside the text is real output
        ("Ġermanja", {}, "Ġermanja"),  # Maltese letter survives when markers are not leaking
    ],
    ids=["sentencepiece", "bytelevel", "whitespace", "cut-multibyte", "inner-fffd", "maltese"],
)
def test_clean_decoded_text(text, kwargs, expected):
    assert clean_decoded_text(text, **kwargs) == expected
