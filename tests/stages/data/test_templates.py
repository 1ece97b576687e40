"""Chat templates applied to every row kind; prompts stay prefixes; preference rows split and unpaired."""
import json

import datasets
import pytest

from stages.builtin import tiny
from stages.data.formats import extract_shared_prompt
from stages.data.templates import (
    apply_chat_template,
    maybe_extract_prompt,
    tool_template_problem,
    unpair_preference_dataset,
)


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer(384)


# ---- maybe_extract_prompt ------------------------------------------------------------------------

def test_extract_prompt_from_shared_messages():
    row = {"chosen": [user("hi"), bot("hello"), user("2+2?"), bot("4")],
           "rejected": [user("hi"), bot("hello"), user("2+2?"), bot("5")], "id": 7}
    assert maybe_extract_prompt(row) == {"prompt": [user("hi"), bot("hello"), user("2+2?")],
                                         "chosen": [bot("4")], "rejected": [bot("5")], "id": 7}


def test_extract_prompt_keeps_a_message_on_each_side_when_one_extends_the_other():
    row = {"chosen": [user("q"), bot("a")], "rejected": [user("q"), bot("a"), user("more"), bot("b")]}
    assert maybe_extract_prompt(row) == {"prompt": [user("q")], "chosen": [bot("a")],
                                         "rejected": [bot("a"), user("more"), bot("b")]}


@pytest.mark.parametrize("chosen, rejected, prompt, c, r", [
    # common prefix "The sky is " is cut before its last space: no word is split, completions keep the space
    ("The sky is blue.", "The sky is green.", "The sky is", " blue.", " green."),
    # the common prefix "I like ca" ends mid-word: cut back to the space before "cats"/"cars"
    ("I like cats", "I like cars", "I like", " cats", " cars"),
    # one side extends the other: the whole shorter side is never taken (a completion is left on each side)
    ("Hello world", "Hello world again", "Hello", " world", " world again"),
])
def test_extract_prompt_from_shared_string_prefix(chosen, rejected, prompt, c, r):
    assert maybe_extract_prompt({"chosen": chosen, "rejected": rejected}) == \
        {"prompt": prompt, "chosen": c, "rejected": r}


@pytest.mark.parametrize("row", [
    {"prompt": "Q:", "chosen": " a b", "rejected": " a c"},          # explicit prompt: left alone
    {"chosen": "Hi there", "rejected": "Hi, there"},                 # shared "Hi" has no word boundary
    {"chosen": [user("a"), bot("x")], "rejected": [user("b"), bot("x")]},  # no shared message
    {"prompt": "q", "completion": "a"},                              # not a preference row
])
def test_extract_prompt_leaves_rows_without_a_shared_prefix_unchanged(row):
    assert maybe_extract_prompt(row) is row


def test_extract_shared_prompt_still_importable_from_formats():
    assert extract_shared_prompt([user("q"), bot("a")], [user("q"), bot("b")])["prompt"] == [user("q")]


# ---- apply_chat_template -------------------------------------------------------------------------

U, A, E = "<|user|>\n", "<|assistant|>\n", "<|end|>"


@pytest.mark.parametrize("row, expected", [
    ({"messages": [user("2+2?"), bot("4")], "id": 1},
     {"text": f"{U}2+2?{E}{A}4{E}", "id": 1}),
    ({"prompt": [user("2+2?")]},
     {"prompt": f"{U}2+2?{E}{A}"}),
    ({"prompt": [user("2+2?")], "completion": [bot("4")]},
     {"prompt": f"{U}2+2?{E}{A}", "completion": f"4{E}"}),
    ({"prompt": [user("2+2?")], "chosen": [bot("4")], "rejected": [bot("5")]},
     {"prompt": f"{U}2+2?{E}{A}", "chosen": f"4{E}", "rejected": f"5{E}"}),
    ({"chosen": [user("2+2?"), bot("4")], "rejected": [user("2+2?"), bot("5")]},  # implicit prompt: whole sides
     {"chosen": f"{U}2+2?{E}{A}4{E}", "rejected": f"{U}2+2?{E}{A}5{E}"}),
    ({"prompt": [user("2+2?")], "completion": [bot("5")], "label": False},
     {"prompt": f"{U}2+2?{E}{A}", "completion": f"5{E}", "label": False}),
])
def test_apply_chat_template_every_row_kind(tok, row, expected):
    assert apply_chat_template(row, tok) == expected


def test_rendered_prompt_is_a_prefix_of_the_whole_conversation(tok):
    row = {"prompt": [{"role": "system", "content": "be brief"}, user("hi"), bot("hello"), user("2+2?")],
           "completion": [bot("4")]}
    out = apply_chat_template(row, tok)
    assert out["prompt"] + out["completion"] == tok.apply_chat_template(row["prompt"] + row["completion"],
                                                                        tokenize=False)
    assert out["completion"] == f"4{E}"


TOOL_TEMPLATE = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                 "{%- for m in messages -%}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
                 "{%- for c in m.get('tool_calls') or [] %}({{ c['function']['arguments'] | tojson }}){% endfor -%}"
                 "<|end|>{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}")
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluates an expression."}}


def test_tools_are_passed_to_the_template():
    tok = tiny.build_tokenizer(384)
    tok.chat_template = TOOL_TEMPLATE
    out = apply_chat_template({"prompt": [user("q")]}, tok, tools=[CALC])
    assert out == {"prompt": f"[calc]{U}q{E}{A}"}


def test_a_rows_tools_column_wins_and_json_strings_are_parsed():
    """The row's `tools` (a JSON string, as a datasets.Dataset keeps it) over the argument; arguments given as a
    JSON string are rendered as the object they hold, not quoted again."""
    tok = tiny.build_tokenizer(384)
    tok.chat_template = TOOL_TEMPLATE
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"x": "1+2"}'}}]}
    row = {"prompt": [user("q")], "completion": [call], "tools": json.dumps([CALC])}
    out = apply_chat_template(row, tok, tools=[{**CALC, "function": {"name": "other"}}])
    assert out["prompt"] == f"[calc]{U}q{E}{A}"
    assert out["completion"] == '({"x": "1+2"})<|end|>'


def test_a_template_that_cannot_render_tools_is_refused_naming_the_model():
    tok = tiny.build_tokenizer(384)
    tok.name_or_path = "my/model"
    with pytest.raises(ValueError, match=r"chat template of 'my/model' cannot render them: rendering a "
                                         r"conversation with a tool call fails.*chatml_tools.jinja"):
        apply_chat_template({"prompt": [user("q")]}, tok, tools=[CALC])
    # renders the tools and the tool turn, but writes an assistant's content only: its calls vanish
    tok.chat_template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                         + tiny.CHAT_TEMPLATE.replace("message['content']", "(message['content'] or '')"))
    assert tool_template_problem(tok) == "it does not render the assistant's tool_calls"
    tok.chat_template = TOOL_TEMPLATE
    assert tool_template_problem(tok) == ""


@pytest.mark.parametrize("row", [
    {"text": "plain"},
    {"prompt": "Q: 2+2?", "completion": " 4"},
    {"prompt": "Q:", "chosen": " 4", "rejected": " 5"},
    {"instruction": "add", "output": "4"},
])
def test_non_conversational_rows_are_returned_unchanged(tok, row):
    assert apply_chat_template(row, tok) is row


def test_tokenizer_without_chat_template_is_explained():
    tok = tiny.build_tokenizer(384)
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"field 'prompt' is a list of chat messages.*no chat_template "
                                         r"\(found None\).*Fix: set tokenizer.chat_template"):
        apply_chat_template({"prompt": [user("q")], "completion": [bot("a")]}, tok)


# Adds an instruction to the user turn only while it is the conversation's last message: the prompt
# renders "2+2? Be brief.", the whole conversation renders "2+2?", so the prompt is not a prefix.
REWRITING = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\n' + m['content'] -}}"
    "{%- if m['role'] == 'user' and loop.last -%}{{- ' Be brief.' -}}{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def test_template_that_rewrites_earlier_turns_is_refused():
    tok = tiny.build_tokenizer(384)
    tok.chat_template = REWRITING
    assert tok.apply_chat_template([user("2+2?")], tokenize=False, add_generation_prompt=True) == \
        f"{U}2+2? Be brief.{E}{A}"
    with pytest.raises(ValueError, match=r"not a prefix of prompt \+ completion.*rewrites earlier turns.*Fix: "
                                         r"use a training template"):
        apply_chat_template({"prompt": [user("2+2?")], "completion": [bot("4")]}, tok)
    with pytest.raises(ValueError, match=r"not a prefix of prompt \+ chosen"):
        apply_chat_template({"prompt": [user("2+2?")], "chosen": [bot("4")], "rejected": [bot("5")]}, tok)
    # rendering a prompt alone is still fine: nothing follows it
    assert apply_chat_template({"prompt": [user("q")]}, tok) == {"prompt": f"{U}q Be brief.{E}{A}"}


# ---- unpair_preference_dataset -------------------------------------------------------------------

PAIRS = [
    {"prompt": "Q1", "chosen": " a", "rejected": " b", "id": 1},
    {"chosen": [user("q"), bot("x")], "rejected": [user("q"), bot("y")], "id": 2},
]
UNPAIRED = [
    {"id": 1, "prompt": "Q1", "completion": " a", "label": True},
    {"id": 1, "prompt": "Q1", "completion": " b", "label": False},
    {"id": 2, "prompt": [user("q")], "completion": [bot("x")], "label": True},
    {"id": 2, "prompt": [user("q")], "completion": [bot("y")], "label": False},
]


def test_unpair_list():
    assert unpair_preference_dataset(PAIRS) == UNPAIRED


def test_unpair_dataset_returns_a_dataset():
    ds = datasets.Dataset.from_list([dict(PAIRS[0], extra=0), dict(PAIRS[0], prompt="Q2", extra=5)])
    out = unpair_preference_dataset(ds)
    assert isinstance(out, datasets.Dataset)
    assert out.to_list() == [
        {"extra": 0, "id": 1, "prompt": "Q1", "completion": " a", "label": True},
        {"extra": 0, "id": 1, "prompt": "Q1", "completion": " b", "label": False},
        {"extra": 5, "id": 1, "prompt": "Q2", "completion": " a", "label": True},
        {"extra": 5, "id": 1, "prompt": "Q2", "completion": " b", "label": False},
    ]


def test_unpair_conversational_dataset_with_implicit_prompt():
    out = unpair_preference_dataset(datasets.Dataset.from_list(PAIRS[1:]))
    assert [{k: r[k] for k in ("prompt", "completion", "label")} for r in out] == \
        [{k: r[k] for k in ("prompt", "completion", "label")} for r in UNPAIRED[2:]]


def test_unpair_row_without_any_shared_prompt_keeps_whole_sides_as_trl_does():
    assert unpair_preference_dataset([{"chosen": "yes", "rejected": "no"}]) == \
        [{"completion": "yes", "label": True}, {"completion": "no", "label": False}]


def test_unpair_dataset_dict_with_trl_arguments():
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(PAIRS[:1]),
                               "test": datasets.Dataset.from_list([dict(PAIRS[0], prompt="Q9")])})
    out = unpair_preference_dataset(dd, num_proc=None, desc="unpair")
    assert isinstance(out, datasets.DatasetDict)
    assert out["train"].to_list() == UNPAIRED[:2]
    assert [r["prompt"] for r in out["test"]] == ["Q9", "Q9"]


def test_extract_prompt_replaces_a_prompt_of_the_other_kind_as_trl_does():
    # a plain-string prompt column beside conversations that repeat it: the conversations' shared turn wins
    row = {"prompt": "2+2?", "chosen": [user("2+2?"), bot("4")], "rejected": [user("2+2?"), bot("5")]}
    assert maybe_extract_prompt(row) == {"prompt": [user("2+2?")], "chosen": [bot("4")], "rejected": [bot("5")]}


def test_prompt_ending_with_an_assistant_message_is_continued(tok):
    out = apply_chat_template({"prompt": [user("2+2?"), bot("The answer is")]}, tok)
    assert out == {"prompt": f"{U}2+2?{E}{A}The answer is"}  # no <|end|>, no new generation prompt


def test_tools_positional_as_in_trl(tok):
    tok2 = tiny.build_tokenizer(384)
    tok2.chat_template = TOOL_TEMPLATE
    assert apply_chat_template({"prompt": [user("q")]}, tok2, [CALC]) == {"prompt": f"[calc]{U}q{E}{A}"}


# ---- assistant_spans: assistant-only masks for templates without {% generation %} markers ----------

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


@pytest.fixture(scope="module")
def chatml():
    """The tiny tokenizer with ChatML's special tokens and template (no generation markers), EOS <|im_end|>."""
    tok = tiny.build_tokenizer(384)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.chat_template = "<|im_end|>", CHATML
    return tok


CONVERSATIONS = [
    [user("What is 2 + 3?"), bot("5")],
    [{"role": "system", "content": "Be brief.\n ok"}, user("2+3"), bot(" It is\n5 .  "), user("and 4+4"), bot("8\n\n")],
    [user("a"), bot("b"), bot("c")],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_assistant_spans_mask_what_generation_markers_mark(tok, conversation):
    """The tiny template marks each assistant content + '<|end|>' with {% generation %}: masks from
    assistant_spans (positions of the rendered prefixes) equal transformers' masks from the markers."""
    from stages.data.templates import assistant_spans, has_generation_markers

    assert has_generation_markers(tok.chat_template)
    enc = tok.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    text, spans = assistant_spans(conversation, tok)
    ours = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ours["input_ids"] == list(enc["input_ids"])
    assert [int(any(s <= a < e for s, e in spans)) for a, _ in ours["offset_mapping"]] == list(enc["assistant_masks"])


def test_assistant_only_masks_on_chatml_token_by_token(chatml):
    """ChatML has no generation markers. Each assistant turn's target tokens are its content and <|im_end|>;
    the role header before it and the newline after <|im_end|> are not targets (TRL's ChatML training
    templates mark the same tokens)."""
    from stages.data.templates import has_generation_markers
    from stages.data.tokenize import tokenize_sft

    assert not has_generation_markers(chatml.chat_template)
    conversation = [user("2+3"), bot("5"), user("4+4"), bot("8 ok")]
    [row] = tokenize_sft(chatml, [{"messages": conversation}], assistant_only=True)
    tokens = chatml.convert_ids_to_tokens(row["input_ids"])

    def enc(text):
        return chatml.convert_ids_to_tokens(chatml(text, add_special_tokens=False)["input_ids"])
    expected = []
    for message in conversation:
        header = enc(f"<|im_start|>{message['role']}\n")
        body = enc(message["content"]) + ["<|im_end|>"]
        target = int(message["role"] == "assistant")
        expected += [(t, 0) for t in header] + [(t, target) for t in body] + [(t, 0) for t in enc("\n")]
    assert list(zip(tokens, row["assistant_masks"], strict=True)) == expected


def test_assistant_spans_refuse_a_template_that_rewrites_earlier_turns():
    from stages.data.templates import assistant_spans

    tok = tiny.build_tokenizer(384)
    # drops every assistant turn but the last: the first turn renders differently once more follows
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="up to message 1 .*cannot be located by position"):
        assistant_spans([user("a"), bot("b"), user("c"), bot("d")], tok)
