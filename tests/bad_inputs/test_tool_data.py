"""Bad tool-calling data: each malformed tool field named by file, line and field, before anything is built;
and tool rows on a model whose chat template cannot render them refused by preprocess, naming the model and
the fix (sft.chat_template_path), which then works."""
from __future__ import annotations

import json

import pytest

from stages.__main__ import main
from tests.bad_inputs.conftest import assert_rejected, escape

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def conversation(i: int, *, calls=None, tool=None) -> list[dict]:
    """user asks i+1; the assistant calls add; the tool answers; the assistant answers."""
    calls = calls if calls is not None else [{"type": "function", "function": {"name": "add",
                                                                               "arguments": {"a": i, "b": 1}}}]
    tool = tool if tool is not None else {"role": "tool", "name": "add", "content": str(i + 1)}
    return [{"role": "user", "content": f"What is {i}+1?"}, {"role": "assistant", "content": None, "tool_calls": calls},
            tool, {"role": "assistant", "content": str(i + 1)}]


def good(n: int = 20) -> list[dict]:
    return [{"messages": conversation(i), "tools": [ADD]} for i in range(n)]


def with_row(line: int, bad: dict) -> bytes:
    rows = good()
    rows.insert(line - 1, bad)
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


CASES = [
    ("call_without_name", with_row(3, {"messages": conversation(3, calls=[{"type": "function", "function": {
        "arguments": {"a": 3, "b": 1}}}]), "tools": [ADD]}),
     r"d\.jsonl:3: field 'messages\[1\]\.tool_calls\[0\]\.function\.name' must be the called function's name"),
    ("arguments_not_json", with_row(4, {"messages": conversation(4, calls=[{"type": "function", "function": {
        "name": "add", "arguments": "{'a': 4, 'b': 1}"}}]), "tools": [ADD]}),
     r"d\.jsonl:4: field 'messages\[1\]\.tool_calls\[0\]\.function\.arguments' is not JSON \(Expecting property "
     r"name enclosed in double quotes at character 1"),
    ("tool_message_without_call", with_row(5, {"messages": [{"role": "user", "content": "What is 5+1?"},
                                                            {"role": "tool", "content": "6"},
                                                            {"role": "assistant", "content": "6"}]}),
     r"d\.jsonl:5: field 'messages\[1\]' is a tool message with no preceding tool call"),
    ("tools_entry_not_a_schema", with_row(6, {"messages": conversation(6), "tools": [ADD, {"name": "mul"}]}),
     r"d\.jsonl:6: field 'tools\[1\]' is not a tool schema: 'type' is None, not 'function'; expected "
     r"\{\"type\": \"function\", \"function\": \{\"name\""),
]


@pytest.mark.parametrize("case, content, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_tool_row_is_named_at_validation(capsys, tmp_path, params_for, case, content, pattern):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    params = params_for({"data": {"source": None, "sft": str(data)}, "policy": {"method": "grpo"},
                         "score": {"enabled": False}})
    assert_rejected(capsys, params, "preprocess", escape(data), pattern, code=2)
    assert not (tmp_path / "artifacts").exists()  # refused before even the model was built


# renders tools, calls and results with the built-in tokenizer's own turn tokens
TINY_TOOLS = ("{%- if tools %}{{ '<|system|>\\n' }}{% for t in tools %}{{ (t | tojson) + '\\n' }}{% endfor %}"
              "{{ '<|end|>' }}{% endif -%}"
              "{%- for m in messages -%}{{ '<|' + ('user' if m['role'] == 'tool' else m['role']) + '|>\\n' }}"
              "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] or '' }}"
              "{%- for c in m.get('tool_calls') or [] %}{{ '<call>' + (c['function'] | tojson) + '</call>' }}"
              "{%- endfor %}{{ '<|end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|end|>' }}{% endif %}"
              "{%- endfor -%}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif -%}")


def test_a_template_that_cannot_render_tools_is_refused_naming_the_model(capsys, tmp_path, params_for, model_dir):
    """builtin:tiny's template writes message['content'] only: preprocess stops (nothing trained), naming
    model.name_or_path and the template to set; with sft.chat_template_path naming a template that renders tools,
    the same data passes and the written rows keep their tools and calls."""
    data = tmp_path / "d.jsonl"
    data.write_bytes(with_row(1, good(1)[0]))
    params = params_for({"data": {"source": None, "sft": str(data)}, "policy": {"method": "grpo"},
                         "score": {"enabled": False}})
    assert_rejected(capsys, params, "preprocess",
                    r"the chat template of model\.name_or_path = '" + escape(model_dir) + r"' cannot render them: "
                    r"rendering a conversation with a tool call fails: UndefinedError",
                    r"Fix: set chat_template_path \(sft\.chat_template_path in params.*chatml_tools\.jinja", code=1)
    template = tmp_path / "tiny_tools.jinja"
    template.write_text(TINY_TOOLS)
    assert main(["preprocess", "--params", str(params), "--set", f"sft.chat_template_path={template}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "artifacts" / "preprocess" / "sft_train.jsonl").open()]
    assert rows and all(r["tools"] == [ADD] for r in rows)
    assert all([m["role"] for m in r["completion"]] == ["assistant", "tool", "assistant"] for r in rows)
    assert all(r["completion"][0]["tool_calls"][0]["function"]["name"] == "add" for r in rows)


def test_the_builtin_task_with_tools_needs_a_template_that_renders_them(capsys, tmp_path, params_for):
    """data.builtin.tools: true on builtin:tiny, whose own template writes content only: refused, naming TINY_TOOLS;
    with sft.chat_template_path set to it, preprocess writes the calls and the schema."""
    from stages.builtin.chat_templates import TINY_TOOLS

    params = params_for({"data": {"builtin": {"tools": True}}})
    assert_rejected(capsys, params, "preprocess", r"cannot render them", r"for builtin:tiny " + escape(TINY_TOOLS),
                    code=1)
    assert main(["preprocess", "--params", str(params), "--set", f"sft.chat_template_path={TINY_TOOLS}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "artifacts" / "preprocess" / "sft_train.jsonl").open()]
    with_calls = [r for r in rows if r["completion"][0].get("tool_calls")]
    assert with_calls and all(r["tools"][0]["function"]["name"] == "add" for r in rows)
    assert [m["role"] for m in with_calls[0]["completion"]] == ["assistant", "tool", "assistant"]
