"""stages.trainers.tool_rollout: which templates can run tool episodes, on real chat templates."""
from pathlib import Path

import pytest

from stages.builtin.chat_templates import CHATML_TOOLS
from stages.tools import parse_tool_calls
from stages.tools.episodes import tool_suffix_ids
from stages.trainers.tool_rollout import check_template
from tests.architectures import train_tokenizer

LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def test_llama31_template_writes_json_calls_and_ipython_turns():
    tok = train_tokenizer(eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                          extra=LLAMA_SPECIALS, chat_template=trl_template("llama3_1"))
    assert check_template(tok, None, "llama") == "llama3_json"
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    assert tok.decode(suffix) == ("<|start_header_id|>ipython<|end_header_id|>\n\n\"5\"<|eot_id|>"
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, call], tokenize=False)
    turn = text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[-1].removesuffix("<|eot_id|>")
    assert parse_tool_calls(turn, "llama3_json").tool_calls == call["tool_calls"]  # what it renders, we read


def test_chatml_tools_and_qwen25_templates_write_hermes_calls():
    for template in (CHATML_TOOLS.read_text(), trl_template("qwen2_5")):
        tok = train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",), chat_template=template)
        assert check_template(tok, None, "chatml") == "hermes"


def test_a_template_without_tools_is_refused_naming_the_model():
    tok = train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                          chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                        "<|im_end|>\n{% endfor %}")
    with pytest.raises(ValueError, match=r"model 'my-model'.*drops tool calls or tool results.*CHATML_TOOLS"):
        check_template(tok, None, "my-model")
    tok.chat_template = None
    with pytest.raises(ValueError, match="model 'my-model': the tokenizer has no chat template"):
        check_template(tok, None, "my-model")
