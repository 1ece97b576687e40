"""Our utilities that mirror TRL's take TRL's arguments: a TRL user's call works unchanged.

Each test makes the call as TRL's documentation writes it and checks the result by hand.
Where TRL is installed (`pip install trl`), the same call is also made on TRL's function and
the results compared; without TRL those comparisons are skipped, the hand-checked ones run.
"""
from __future__ import annotations

import datasets
import pytest
import torch

from stages.builtin import tiny
from stages.data import apply_chat_template, is_conversational, maybe_extract_prompt, unpair_preference_dataset
from stages.tensors import pad, pad_to_length, selective_log_softmax

SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE = [{"role": "assistant", "content": "It is blue."}]
GREEN = [{"role": "assistant", "content": "It is green."}]

EXAMPLES = [  # (example, conversational?)
    ({"messages": SKY + BLUE}, True),
    ({"prompt": SKY}, True),
    ({"prompt": SKY, "completion": BLUE}, True),
    ({"prompt": SKY, "chosen": BLUE, "rejected": GREEN}, True),
    ({"chosen": SKY + BLUE, "rejected": SKY + GREEN}, True),
    ({"prompt": SKY, "completion": BLUE, "label": True}, True),
    ({"text": "The sky is blue."}, False),
    ({"prompt": "The sky is"}, False),
    ({"prompt": "The sky is", "completion": " blue."}, False),
    ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, False),
    ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, False),
]


def trl(name: str):
    data_utils = pytest.importorskip("trl.data_utils")
    return getattr(data_utils, name)


@pytest.mark.parametrize("example, expected", EXAMPLES)
def test_is_conversational_takes_an_example(example, expected):
    assert is_conversational(example) is expected


@pytest.mark.parametrize("example, expected", EXAMPLES)
def test_is_conversational_agrees_with_trl(example, expected):
    assert trl("is_conversational")(example) is expected


def test_is_conversational_refuses_a_field_value_instead_of_silently_answering_false():
    with pytest.raises(TypeError, match="takes a row"):
        is_conversational(SKY)


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer(384)


@pytest.mark.parametrize("example", [e for e, conv in EXAMPLES if conv])
def test_apply_chat_template_agrees_with_trl(tok, example):
    ours = apply_chat_template(example, tok)
    theirs = trl("apply_chat_template")(example, tok)
    assert {k: ours[k] for k in theirs} == theirs


def test_apply_chat_template_docs_call(tok):
    out = apply_chat_template({"prompt": SKY, "completion": BLUE}, tok)
    assert out == {"prompt": "<|user|>\nWhat color is the sky?<|end|><|assistant|>\n",
                   "completion": "It is blue.<|end|>"}


def test_maybe_extract_prompt_docs_call():
    example = {"chosen": SKY + BLUE, "rejected": SKY + GREEN}
    assert maybe_extract_prompt(example) == {"prompt": SKY, "chosen": BLUE, "rejected": GREEN}


@pytest.mark.parametrize("example", [
    {"chosen": SKY + BLUE, "rejected": SKY + GREEN},
    {"prompt": "What color is the sky?", "chosen": SKY + BLUE, "rejected": SKY + GREEN},
    {"prompt": SKY, "chosen": BLUE, "rejected": GREEN},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # a word boundary: both cut alike
    {"prompt": "q", "completion": "a"},
])
def test_maybe_extract_prompt_agrees_with_trl(example):
    assert maybe_extract_prompt(example) == trl("maybe_extract_prompt")(example)


def test_unpair_preference_dataset_docs_call():
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"], "chosen": [" blue.", "in the sky."],
                                          "rejected": [" green.", " in the sea."]})
    out = unpair_preference_dataset(dataset)
    assert out.num_rows == 4 and set(out.column_names) == {"prompt", "completion", "label"}
    assert out[0] == {"prompt": "The sky is", "completion": " blue.", "label": True}
    theirs = trl("unpair_preference_dataset")(dataset)
    key = lambda r: (r["prompt"], r["completion"], r["label"])  # noqa: E731 (TRL orders each map batch differently)
    assert sorted(map(key, out)) == sorted(map(key, theirs))


def test_pad_docs_calls():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    assert torch.equal(pad([a, b]), torch.tensor([[1, 2, 3], [4, 5, 0]]))
    assert torch.equal(pad([a, b], padding_side="left"), torch.tensor([[1, 2, 3], [0, 4, 5]]))
    assert torch.equal(pad([a, b], 9, "right", 4), torch.tensor([[1, 2, 3, 9], [4, 5, 9, 9]]))
    trl_pad = pytest.importorskip("trl.trainer.utils").pad
    for kwargs in ({}, {"padding_side": "left"}, {"padding_value": 9, "pad_to_multiple_of": 4}):
        assert torch.equal(pad([a, b], **kwargs), trl_pad([a, b], **kwargs))


def test_pad_to_length_docs_calls():
    t = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(pad_to_length(t, 4, pad_value=0), torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0]]))
    assert torch.equal(pad_to_length(t, 3, 7, dim=0), torch.tensor([[1, 2], [3, 4], [7, 7]]))
    assert pad_to_length(t, 1, 0) is t  # longer: unchanged, as in TRL
    trl_pad_to_length = pytest.importorskip("trl.experimental.utils").pad_to_length  # TRL 1.16 keeps it there
    for args, kwargs in (((4,), {"pad_value": 0}), ((3, 7), {"dim": 0}), ((1, 0), {})):
        assert torch.equal(pad_to_length(t, *args, **kwargs), trl_pad_to_length(t, *args, **kwargs))


def test_selective_log_softmax_docs_call():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 5, 10], [3, 3, 1]])
    expected = torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, index), expected, atol=1e-6)
    trl_sls = pytest.importorskip("trl.trainer.utils").selective_log_softmax
    assert torch.allclose(selective_log_softmax(logits, index), trl_sls(logits, index), atol=1e-6)
