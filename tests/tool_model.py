"""A tiny ChatML model that calls tools, built locally for the tool-calling tests.

The tokenizer is a byte-level BPE trained on the built-in task's corpus plus the transcripts below, with
ChatML's special tokens and align's tool template (`stages.builtin.chat_templates.CHATML_TOOLS`); the model is
a random Llama (2 layers, hidden 64) taught the transcripts by a few hundred plain next-token steps, so that it
answers each scripted prompt with its scripted tool call, and the tool's answer with the scripted reply:

| prompt        | the model's call                                      | tool answer                | reply  |
|---------------|-------------------------------------------------------|----------------------------|--------|
| Add 2 and 3.  | add(a=2, b=3)                                         | 5                          | 5      |
| Use boom.     | boom()                                                | {"error": "RuntimeError..."} | failed |
| Use hang.     | hang()                                                | {"error": "timed out ..."} | failed |
| Bad call.     | `<tool_call>{"name": "add", "arguments": </tool_call>` | {"error": "could not ..."}  | failed |
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

BAD_CALL = '<tool_call>{"name": "add", "arguments": </tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom() -> str:
    """A tool that always fails."""
    raise RuntimeError("boom")


def hang() -> str:
    """A tool that never answers in time."""
    time.sleep(60)
    return "late"


TOOLS = [add, boom, hang]


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def error(text: str) -> str:
    return json.dumps({"error": text})


# (prompt, the model's first turn as a message, the tool turn, the reply)
SCRIPTS = [
    ("Add 2 and 3.", {"role": "assistant", "content": None, "tool_calls": [call("add", a=2, b=3)]},
     {"role": "tool", "name": "add", "content": "5"}, "5"),
    ("Use boom.", {"role": "assistant", "content": None, "tool_calls": [call("boom")]},
     {"role": "tool", "name": "boom", "content": error("RuntimeError: boom")}, "failed"),
    ("Use hang.", {"role": "assistant", "content": None, "tool_calls": [call("hang")]},
     {"role": "tool", "name": "hang", "content": error("timed out after 1.0 s")}, "failed"),
    ("Bad call.", {"role": "assistant", "content": BAD_CALL},
     {"role": "tool", "name": "invalid_tool_call",
      "content": error("could not parse the tool call: tool call 1: invalid JSON (Expecting value: line 1 column "
                       "29 (char 28)): '{\"name\": \"add\", \"arguments\":'")}, "failed"),
]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": p}, first, tool, {"role": "assistant", "content": reply}]
            for p, first, tool, reply in SCRIPTS]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from stages.builtin import arithmetic
    from stages.builtin.chat_templates import CHATML_TOOLS

    template = CHATML_TOOLS.read_text()
    specials = ["<|pad|>", "<|im_end|>", "<|im_start|>"]
    bootstrap = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=template)
    texts = [bootstrap.apply_chat_template(c, tools=TOOLS, tokenize=False) for c in conversations()]
    tok = Tokenizer(models.BPE())
    # pieces never span a line break or a digit, so a turn tokenises the same alone and inside a conversation
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                 pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([*arithmetic.corpus(500), *texts * 20], trainer=trainers.BpeTrainer(
        vocab_size=2000, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   additional_special_tokens=specials[2:], chat_template=template,
                                   model_max_length=1024, padding_side="left")


def build(folder: Path, steps: int = 150) -> Path:
    """The tokenizer and a model that learned `SCRIPTS`, saved in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    rows = [tok.apply_chat_template(c, tools=TOOLS, tokenize=True, return_dict=False) for c in conversations()]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    """The folder of the tiny tool-calling model (built once per session)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build(tmp_path_factory.mktemp("tool_model"))
    finally:
        torch.set_num_threads(threads)
