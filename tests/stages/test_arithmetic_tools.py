"""The built-in task with a calculator: episodes that call `add`, a schema that matches the function,
labeller errors that skip the call, and chat templates that render it all with the tool turns unmarked."""
import dataclasses

import pytest

from stages.builtin import arithmetic, arithmetic_tools
from stages.builtin.chat_templates import CHATML_TOOLS, TINY_TOOLS
from stages.harness.config import ArithmeticConfig


def _task(**kw):
    cfg = dataclasses.replace(ArithmeticConfig(num_train=400, num_preference=50, num_eval=30, num_dev=10), **kw)
    return arithmetic.generate(**dataclasses.asdict(cfg))


def test_schema_is_what_transformers_derives_from_the_function():
    from transformers.utils import get_json_schema

    assert get_json_schema(arithmetic_tools.add) == arithmetic_tools.ADD_SCHEMA


def test_same_sums_and_errors_with_and_without_tools():
    plain, tools = _task(), _task(tools=True)
    for name in plain:
        assert len(plain[name]) == len(tools[name]), name
        assert all(r["tools"] == [arithmetic_tools.ADD_SCHEMA] for r in tools[name]), name
    for p, t in zip(plain["sft"], tools["sft"], strict=True):
        assert p["messages"][0] == t["messages"][0]
        user = p["messages"][0]["content"]
        a, b = map(int, user.split("+"))
        if p["messages"][1]["content"].endswith(f"</think>{a + b}"):  # a right demonstration uses the tool
            assert t["messages"][1:] == [arithmetic_tools.call(a, b), arithmetic_tools.result(a + b),
                                         {"role": "assistant", "content": str(a + b)}]
        else:  # a labeller's error: by hand, with the carry dropped, no call
            assert t["messages"][1:] == p["messages"][1:]
    skipped = sum(len(r["messages"]) == 2 for r in tools["sft"])
    assert 0.1 * len(tools["sft"]) < skipped < 0.6 * len(tools["sft"])
    assert plain["eval"][0]["prompt"] == tools["eval"][0]["prompt"]


def test_held_out_references_reach_the_right_answer_through_the_tool():
    for r in _task(tools=True)["eval"]:
        a, b = map(int, r["prompt"][0]["content"].split("+"))
        assert r["completion"][0]["tool_calls"][0]["function"]["arguments"] == {"a": a, "b": b}
        assert r["completion"][-1] == {"role": "assistant", "content": str(a + b)}


@pytest.mark.parametrize("template, tokens", [(TINY_TOOLS, ("<|assistant|>\n", "<|end|>")),
                                              (CHATML_TOOLS, ("<|im_start|>assistant\n", "<|im_end|>"))])
def test_templates_render_calls_and_mark_only_the_assistant(template, tokens):
    """Rendered as text (no tokenizer needed): the call, the result in a tool turn, and generation markers
    around exactly the two assistant turns."""
    import jinja2

    row = _task(tools=True)["sft"][0]
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v: __import__("json").dumps(v)
    source = template.read_text().replace("{%- generation -%}", "[[").replace("{%- endgeneration -%}", "]]")
    text = env.from_string(source).render(messages=row["messages"], tools=row["tools"], add_generation_prompt=False)
    a, b = map(int, row["messages"][0]["content"].split("+"))
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    start, end = tokens
    assert text.count("[[") == 2
    assert f"{start}[[{call}{end}]]" in text and f"{start}[[{a + b}{end}]]" in text
    assert "add" in text.split(call)[0]  # the tool is announced before the first call
    assert f"{a + b}" in text.split(call)[1].split("[[")[0]  # the result comes back before the answer, unmarked
