"""The embedded default: deterministic task and model, digits as single tokens, a usable chat template."""
import dataclasses

import pytest

from stages.builtin import arithmetic, tiny
from stages.harness import artifacts
from stages.harness.config import ArithmeticConfig, TinyModelConfig


def _task(**kw):
    cfg = dataclasses.replace(ArithmeticConfig(num_train=500, num_preference=100, num_eval=50), **kw)
    return arithmetic.generate(**dataclasses.asdict(cfg))


def test_task_is_deterministic_and_seeded():
    assert _task() == _task()
    assert _task()["sft"] != _task(seed=1)["sft"]


def test_eval_prompts_never_in_training_splits():
    splits = _task()
    eval_prompts = {r["prompt"][0]["content"] for r in splits["eval"]}
    for name in ("sft", "preference", "unpaired", "prompts"):
        rows = splits[name]
        seen = {(r["messages"][0] if "messages" in r else r["prompt"][0])["content"] for r in rows}
        assert not eval_prompts & seen, name


def test_errors_are_systematic_dropped_carries():
    splits = _task(error_rate=0.7, reasoning=False)
    carry_rows = wrong = 0
    for r in splits["sft"]:
        a, b = map(int, r["messages"][0]["content"].split("+"))
        got = int(r["messages"][1]["content"])
        if arithmetic.needs_carry(a, b):
            carry_rows += 1
            if got != a + b:
                wrong += 1
                assert got == arithmetic.add(a, b, drop_carry=True)[0]
        else:
            assert got == a + b  # sums without a carry are always right
    assert 0.6 < wrong / carry_rows < 0.8


def test_add_column_arithmetic():
    assert arithmetic.add(47, 85) == (132, "7+5=12, 4+8+1=13")
    assert arithmetic.add(47, 85, drop_carry=True)[0] == 122
    assert arithmetic.add(50, 60, drop_carry=True)[0] == 110  # only the top column overflows: no error possible
    assert not arithmetic.needs_carry(50, 60) and arithmetic.needs_carry(47, 85)


def test_reasoning_variant_and_preferences():
    splits = _task(reasoning=True)
    answer = splits["sft"][0]["messages"][1]["content"]
    assert answer.startswith("<think>") and "</think>" in answer
    for r in splits["preference"]:
        a, b = map(int, r["prompt"][0]["content"].split("+"))
        assert r["chosen"][0]["content"].endswith(f"</think>{a + b}")
        assert not r["rejected"][0]["content"].endswith(f"</think>{a + b}")
    assert {r["label"] for r in splits["unpaired"]} == {True, False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = dataclasses.asdict(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    return [tiny.build(tmp_path_factory.mktemp(f"tiny{i}"), **spec) for i in range(2)]


def test_model_build_is_deterministic(tiny_dir):
    a, b = (artifacts.file_hashes(d) for d in tiny_dir)
    assert a == b and "model.safetensors" in a and "tokenizer.json" in a


def test_loads_with_auto_classes(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir[0])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir[0])
    assert model.config.model_type == "llama"
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    ids = tok("12345+678", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("12345+678")  # one token per digit
    for tag in ("<think>", "</think>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_prompt_is_prefix_and_marks_assistant(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir[0])
    msgs = [{"role": "user", "content": "47+85"}, {"role": "assistant", "content": "132"}]
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert full == prompt + "132<|end|>" and prompt.endswith("<|assistant|>\n")
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tok.decode(marked) == "132<|end|>"


def test_error_kind_names_each_slip():
    from stages.builtin.arithmetic import add, answer_text
    from stages.builtin.arithmetic_errors import error_kind

    right = answer_text(*add(58, 98))  # <think>8+8=16, 5+9+1=15</think>156
    assert error_kind(58, 98, right) is None
    assert error_kind(58, 98, answer_text(*add(58, 98, drop_carry=True))) == "dropped carry"
    assert error_kind(58, 98, "<think>8+8=16, 5+9+1=14</think>146") == "carry written, wrong sum"
    assert error_kind(58, 98, "<think>8+8=16, 5+9+1=15</think>155") == "right steps, wrong answer"
    assert error_kind(72, 63, "<think>2+3=5, 7+6=14</think>145") == "other step error"
    assert error_kind(72, 63, "135") == "no reasoning block"
    assert error_kind(72, 63, answer_text(*add(72, 63))) is None
