"""stages.tools.calls: tool calls read in the chat template's format; every malformed call reported."""
import pytest

from stages.builtin.chat_templates import CHATML_TOOLS
from stages.tools.calls import format_for_template, parse_hermes, parse_llama3_json, parse_tool_calls


def fn(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_hermes_reads_several_calls_and_keeps_the_text_around_them():
    text = ('Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>')
    turn = parse_hermes(text)
    assert turn.tool_calls == [fn("add", a=2, b=3), fn("now")]
    assert turn.content == "Let me add." and turn.errors == [] and turn.wants_tools
    assert turn.message() == {"role": "assistant", "content": "Let me add.", "tool_calls": turn.tool_calls}


def test_hermes_calls_only_give_content_none_and_plain_text_no_calls():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>').message()["content"] is None
    plain = parse_hermes("The answer is 5.")
    assert plain.tool_calls == [] and plain.errors == [] and not plain.wants_tools
    assert plain.message() == {"role": "assistant", "content": "The answer is 5."}


@pytest.mark.parametrize("body, why", [
    ('{"name": "add", "arguments": ', "invalid JSON"),
    ('["add"]', "expected a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
    ('{"name": "add", "arguments": "a=1"}', "a string that is not JSON"),
])
def test_hermes_malformed_calls_are_reported_not_dropped(body, why):
    turn = parse_hermes(f'<tool_call>{body}</tool_call> and <tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>')
    assert turn.tool_calls == [fn("ok")]
    assert len(turn.errors) == 1 and turn.errors[0].startswith("tool call 1") and why in turn.errors[0]
    assert body in turn.content  # what the model wrote stays visible


def test_hermes_unclosed_call_is_an_error():
    turn = parse_hermes('Sure <tool_call>{"name": "add", "arguments": {"a": 1')
    assert turn.tool_calls == [] and "unclosed <tool_call>" in turn.errors[0] and turn.wants_tools


def test_llama3_json_call_plain_text_and_malformed():
    turn = parse_llama3_json('{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert turn.tool_calls == [fn("add", a=2, b=3)] and turn.errors == []
    assert parse_llama3_json("<|python_tag|>{\"name\": \"f\", \"arguments\": {}}").tool_calls == [fn("f")]
    assert parse_llama3_json("It is 5.").message() == {"role": "assistant", "content": "It is 5."}
    bad = parse_llama3_json('{"name": "add", "parameters": {"a": 2')
    assert bad.tool_calls == [] and "invalid JSON" in bad.errors[0]


def test_format_follows_the_template_and_unknown_ones_are_refused():
    assert format_for_template(CHATML_TOOLS.read_text()) == "hermes"
    assert format_for_template('{{- \'{"name": "\' + t.name + \'", "parameters": \' }}') == "llama3_json"
    with pytest.raises(ValueError, match="model 'm'.*CHATML_TOOLS"):
        format_for_template("{{ messages }}", owner="model 'm'")
    with pytest.raises(ValueError, match="unknown; supported: hermes, llama3_json"):
        parse_tool_calls("x", "xml")
