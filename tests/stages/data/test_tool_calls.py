"""Tool-calling rows (stages.data.tool_calls, and the formats, templates and tokenisation that use it): valid rows
of every kind pass and keep their tools; each malformed tool field is named; assistant-only masks cover the
model's calls and answers and nothing else, token by token, on a Qwen2.5-style template (no generation markers:
spans from prefixes) and on align's CHATML_TOOLS (generation markers: transformers' mask)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.builtin.chat_templates import CHATML_TOOLS
from stages.data.formats import detect_format, normalise, validate
from stages.data.templates import tool_template_problem
from stages.data.tokenize import render_prompt, tokenize_sft
from stages.data.tool_calls import tool_schemas, tools_problem
from tests import architectures

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def call(name="add", arguments=None):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function",
                            "function": {"name": name, "arguments": arguments or {"a": 2, "b": 3}}}]}


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def result(content="5", name="add"):
    return {"role": "tool", "name": name, "content": content}


SYSTEM = {"role": "system", "content": "Use the tools."}
CONVERSATION = [SYSTEM, user("What is 2+3?"), call(), result(), bot("5")]


# ---- valid rows of every kind ----------------------------------------------------------------------------

@pytest.mark.parametrize("row, fmt", [
    ({"messages": CONVERSATION, "tools": [ADD]}, "messages"),
    ({"messages": CONVERSATION, "tools": json.dumps([ADD])}, "messages"),  # the column as one JSON string
    ({"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:], "tools": [ADD]}, "prompt_completion"),
    ({"prompt": CONVERSATION[:4], "completion": [bot("5")], "tools": [ADD]}, "prompt_completion"),  # ends w/ result
    ({"prompt": CONVERSATION[:2], "chosen": CONVERSATION[2:], "rejected": [bot("6")], "tools": [ADD]}, "preference"),
    ({"chosen": CONVERSATION, "rejected": CONVERSATION[:2] + [bot("6")], "tools": [ADD]}, "preference"),
    ({"prompt": CONVERSATION[:2], "completion": [call()], "label": True, "tools": [ADD]}, "unpaired"),  # ends on a call
    ({"prompt": CONVERSATION[:2], "tools": [ADD]}, "prompt_only"),
    ({"prompt": [user("2+3?"), call("add", '{"a": 2, "b": 3}'), result()], "tools": [ADD]}, "prompt_only"),
])
def test_tool_rows_of_every_kind_are_valid(row, fmt):
    assert detect_format(row) == fmt
    assert validate(fmt, row) == ""
    assert normalise(fmt, row)["tools"] == row["tools"]  # the column travels with the row


def test_a_tool_conversation_is_split_after_its_last_user_message():
    """Its completion is the model's whole reply: the call, the result it was given, and the answer (the result
    is masked out of the loss by assistant_only_loss, not by the split)."""
    out = normalise("messages", {"messages": [user("hi"), bot("hello"), *CONVERSATION[1:]], "tools": [ADD]})
    assert out["prompt"] == [user("hi"), bot("hello"), user("What is 2+3?")]
    assert out["completion"] == [call(), result(), bot("5")]
    plain = normalise("messages", {"messages": [user("hi"), bot("hello"), user("2+3?"), bot("5")]})
    assert plain["prompt"] == [user("hi"), bot("hello"), user("2+3?")]  # rows without tools: as before


# ---- malformed tool fields, each named ----------------------------------------------------------------------

@pytest.mark.parametrize("row, why", [
    ({"messages": [user("q"), {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"arguments": {}}}]}, result(), bot("5")]},
     "field 'messages[1].tool_calls[0].function.name' must be the called function's name, got None"),
    ({"messages": [user("q"), call("add", '{"a": 2, "b": '), result(), bot("5")]},
     "field 'messages[1].tool_calls[0].function.arguments' is not JSON (Expecting value at character 14"),
    ({"messages": [user("q"), call("add", "[2, 3]"), result(), bot("5")]},
     "field 'messages[1].tool_calls[0].function.arguments' must be an object of arguments"),
    ({"messages": [user("q"), result(), bot("5")]},
     "field 'messages[1]' is a tool message with no preceding tool call"),
    ({"messages": [user("q"), call(), result(), result(), bot("5")]},  # two results for one call
     "field 'messages[3]' is a tool message with no preceding tool call"),
    ({"messages": [user("q"), call(), result(name="mul"), bot("5")]},
     "field 'messages[2].name' = 'mul' answers no call of the assistant turn before it (it called add)"),
    ({"prompt": [user("q")], "completion": [result(), bot("5")]},
     "field 'completion[0]' is a tool message with no preceding tool call"),
    ({"messages": [user("q"), {"role": "assistant", "content": None}]},
     "field 'messages[1].content' must be a string (or tool_calls), got NoneType"),
    ({"messages": [user("q"), {"role": "assistant", "content": None, "tool_calls": [{"name": "add"}]}]},
     "field 'messages[1].tool_calls[0]' must be a tool call {\"type\": \"function\", \"function\""),
    ({"messages": [user("q"), bot("5")], "tools": [{"name": "add"}]},
     "field 'tools[0]' is not a tool schema: 'type' is None, not 'function'"),
    ({"messages": [user("q"), bot("5")], "tools": [ADD, "add"]},
     "field 'tools[1]' is not a tool schema: got str 'add'"),
    ({"messages": [user("q"), bot("5")], "tools": {"add": ADD}},
     "field 'tools' must be a list of tool schemas, got dict"),
    ({"messages": [user("q"), bot("5")], "tools": "[{"},
     "field 'tools' is a string but not JSON"),
    ({"messages": [user("q"), bot("5")], "tools": [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "array"}}}]},
     "field 'tools[0]' is not a tool schema: 'function.parameters' must be a JSON schema object"),
    ({"prompt": [user("q"), {"role": "user", "content": "x", "tool_calls": []}], "completion": [bot("5")]},
     "field 'prompt[1]' has tool_calls but role 'user'"),
])
def test_malformed_tool_fields_are_named(row, why):
    assert why in validate(detect_format(row), row)


def test_python_functions_are_tools_in_the_api():
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b

    assert tools_problem([multiply]) == ""
    schema = tool_schemas([multiply, ADD])
    assert schema[0]["function"]["name"] == "multiply"
    assert schema[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                       "description": "the first factor"}
    assert schema[1] is ADD
    assert tool_schemas([]) is None and tool_schemas(None) is None


# ---- assistant-only masks, token by token ---------------------------------------------------------------------

# Qwen2.5-Instruct's template as it renders tools (its default system prompt shortened; the file beside this one):
# tool results come back in a *user* turn, and there are no {% generation %} markers, so the masks come from
# stages.data.templates.assistant_spans.
QWEN25 = (Path(__file__).parent / "qwen2_5_tools.jinja").read_text()

# what each template writes for the model's two turns, from after "<|im_start|>assistant\n" through <|im_end|>
EXPECTED = {
    "qwen2.5": ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
                "5<|im_end|>"],
    "chatml_tools": ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
                     "5<|im_end|>"],
}


@pytest.fixture(scope="module", params=["qwen2.5", "chatml_tools"])
def chatml(request):
    """A ChatML tokenizer (byte-level BPE with <|im_start|> / <|im_end|>, EOS <|im_end|>) with the template."""
    template = QWEN25 if request.param == "qwen2.5" else CHATML_TOOLS.read_text()
    tok = architectures.train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                                        chat_template=template)
    tok.model_max_length = 4096
    return request.param, tok


@pytest.mark.parametrize("form", ["messages", "prompt_completion"])
def test_assistant_only_loss_masks_system_user_and_tool_turns(chatml, form):
    """The tokens that carry loss decode to exactly the assistant's call and answer (each with its <|im_end|>):
    not the tools in the system turn, not the user's question, not the tool's result (which Qwen2.5 renders in
    a user turn)."""
    name, tok = chatml
    row = {"messages": CONVERSATION, "tools": [ADD]}
    if form == "prompt_completion":  # as preprocess writes it: split after the last user message
        row = normalise("messages", row)
    t = tokenize_sft(tok, [row], assistant_only=True)[0]
    loss = [a * c for a, c in zip(t["assistant_masks"], t["completion_mask"], strict=True)]
    kept = [i for i, m in zip(t["input_ids"], loss, strict=True) if m]
    assert tok.decode(kept) == "".join(EXPECTED[name])
    text = tok.decode(t["input_ids"])
    for masked in ("Use the tools.", "Add two integers.", "What is 2+3?", "<tool_response>"):
        assert masked in text  # rendered, but not trained on
    # token by token: a token carries loss iff it starts inside one of the two assistant turns of the text
    starts, spans, pos = [], [], 0
    for piece in EXPECTED[name]:
        pos = text.index("<|im_start|>assistant\n", pos) + len("<|im_start|>assistant\n")
        assert text[pos:pos + len(piece)] == piece
        spans.append((pos, pos + len(piece)))
    for i in range(len(t["input_ids"])):
        starts.append(len(tok.decode(t["input_ids"][:i])))
    assert loss == [int(any(s <= c < e for s, e in spans)) for c in starts]
    counts = (sum(loss), len(loss))
    print(f"[{name} {form}] {counts[0]} of {counts[1]} tokens carry loss")
    assert 0 < counts[0] < counts[1] / 3


def test_prompts_render_with_their_tools(chatml):
    """A prompt row's tools column reaches the template (what an online method's sampler is given)."""
    _, tok = chatml
    text = render_prompt(tok, [user("What is 2+3?")], [ADD])
    assert '"name": "add"' in text and text.endswith("<|im_start|>assistant\n")
    assert '"name": "add"' not in render_prompt(tok, [user("What is 2+3?")])


def test_both_templates_pass_the_probe(chatml):
    _, tok = chatml
    assert tool_template_problem(tok) == ""


def test_the_readme_row_is_valid():
    """README's "Tool-calling data" example, parsed from README itself."""
    from tests.conftest import ROOT

    section = (ROOT / "README.md").read_text().split("### Tool-calling data\n", 1)[1]
    row = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    assert detect_format(row) == "messages" and validate("messages", row) == ""
    assert [m["role"] for m in normalise("messages", row)["completion"]] == ["assistant", "tool", "assistant"]
