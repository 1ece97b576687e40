"""Chat templates applied to rows: conversational rows in, rendered strings out.

Three pure helpers with TRL's signatures (`trl.data_utils`), each on one row (a dict) or a whole dataset:

- `maybe_extract_prompt(example)`: a preference row without a "prompt" whose chosen and rejected share a
  beginning gets that beginning as its explicit prompt;
- `apply_chat_template(example, tokenizer, tools=None)`: a conversational row of any kind (messages,
  prompt_only, prompt_completion, preference, unpaired) rendered to strings with the tokenizer's chat
  template. The rendered prompt is always a prefix of prompt + completion, so completion masks can be built
  from positions; columns beyond the row kind's own are kept;
- `unpair_preference_dataset(dataset)`: each prompt/chosen/rejected row becomes two prompt/completion/label
  rows (chosen -> True, rejected -> False).

Plus `assistant_spans(messages, tokenizer)`: a conversation rendered whole with the character spans of its
assistant turns, for assistant-only loss masks with templates that have no `{% generation %}` markers; and
`tool_template_problem(tokenizer)`: whether the chat template renders tools, tool calls and tool results at
all (every rendering of a conversation that uses tools checks it first, `require_tool_template`).

Where they differ from TRL's, each docstring says so.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stages.data.formats import detect_format, extract_shared_prompt, is_messages
from stages.data.tool_calls import parsed_messages, tool_schemas, uses_tools

__all__ = ["apply_chat_template", "assistant_spans", "has_generation_markers", "maybe_extract_prompt",
           "read_chat_template", "require_tool_template", "tool_template_problem", "unpair_preference_dataset"]


def maybe_extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """A preference row with its shared beginning moved into an explicit "prompt".

    Conversations: the leading messages both chosen and rejected share become the prompt
    (each side keeps at least its last message). Plain strings: the longest common
    prefix, cut back to its last whitespace so no word is split; the whitespace starts
    the completions (" blue." rather than "blue."). (TRL cuts strings at the first
    differing character, which can split a word: "bl" + "ue" vs "bl" + "ack".)

    As in TRL, a "prompt" of another kind than chosen (a string prompt beside message
    lists that repeat it) is replaced by the extracted one. Rows with a prompt of the same
    kind, rows that are not preference rows and rows whose sides share nothing are
    returned unchanged (the same object).
    """
    row = example
    if "chosen" not in row or "rejected" not in row:
        return row
    if "prompt" in row and is_messages(row["prompt"]) == is_messages(row["chosen"]):
        return row
    chosen, rejected = row["chosen"], row["rejected"]
    if is_messages(chosen) and is_messages(rejected):
        split = extract_shared_prompt(chosen, rejected)
        return {**row, **split} if split["prompt"] else row
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = _common_prefix_length(chosen, rejected)
        cut = max((i for i in range(n) if chosen[i].isspace()), default=0)
        if cut == 0:
            return row
        return {**row, "prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}
    return row


def _common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter string bounds the prefix
        if x != y:
            break
        n += 1
    return n


def apply_chat_template(example: dict[str, Any], tokenizer, tools: list | None = None) -> dict[str, Any]:
    """A conversational row rendered to strings with `tokenizer`'s chat template (table above).

    Completions are rendered as part of the whole conversation, then cut after the
    rendered prompt, so the special tokens that close each turn are in the completion.
    `tools` (JSON schemas or Python functions) is passed to the template; a row's own `tools` column, where it
    has one, is used instead (TRL's trainers read that column per row; its `apply_chat_template` takes the
    argument only). A conversation with tools is rendered only by a template that can show them
    (`require_tool_template`). A prompt-only row whose prompt ends
    with an assistant message is continued (no generation prompt), as in TRL.
    Non-conversational rows are returned unchanged (the same object), where TRL raises;
    columns beyond the row kind's are kept, where TRL drops them. Preference rows without
    a prompt are rendered whole, side by side, as in TRL (call `maybe_extract_prompt` first
    to split off the shared prompt).

    Raises ValueError when the tokenizer has no chat template, or when the template
    renders the prompt differently once a completion follows (it rewrites earlier turns).
    """
    row = example
    kind = detect_format(row)
    render = _RENDERERS.get(kind) if kind is not None else None
    field = "messages" if kind == "messages" else "chosen" if kind == "preference" else "prompt"
    if render is None or not is_messages(row[field]):
        return row
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"row field {field!r} is a list of chat messages, but the tokenizer "
                         f"({type(tokenizer).__name__}) has no chat_template (found None); expected a tokenizer "
                         "with a chat template to render it. Fix: set tokenizer.chat_template (for a base model, "
                         "copy the template of its instruct version), or give the rows as plain strings.")
    return render(row, _Renderer(tokenizer, row["tools"] if row.get("tools") is not None else tools))


class _Renderer:
    """The tokenizer's chat template with one row's tools (schemas), checked once able to show them."""

    def __init__(self, tokenizer, tools):
        self.tokenizer, self.tools = tokenizer, tool_schemas(tools)

    def __call__(self, messages: list[dict], *, generation_prompt: bool = False, continue_final: bool = False
                 ) -> str:
        if uses_tools(messages, self.tools):
            require_tool_template(self.tokenizer)
            messages = parsed_messages(messages)
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  continue_final_message=continue_final)

    def split(self, prompt: list[dict], completion: list[dict], field: str) -> tuple[str, str]:
        """(prompt text, completion text) with prompt text + completion text == the whole rendering."""
        prompt_text = self(prompt, generation_prompt=True)
        full = self(prompt + completion)
        if not full.startswith(prompt_text):
            raise ValueError(
                f"the chat template renders the prompt differently once {field!r} is appended, so the rendered "
                f"prompt is not a prefix of prompt + {field} (prompt ends {prompt_text[-60:]!r}, the full text "
                f"has {full[max(0, len(prompt_text) - 60):len(prompt_text)]!r} there). The template rewrites "
                "earlier turns depending on what follows (e.g. it strips reasoning from past assistant turns, or "
                "its generation prompt differs from how it opens an assistant turn). Fix: use a training template "
                "whose rendering of the prompt with add_generation_prompt=True is a prefix of the full "
                "conversation (set tokenizer.chat_template), or give the rows as plain strings.")
        return prompt_text, full[len(prompt_text):]


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether a chat template marks assistant content with `{% generation %}` (what transformers'
    `return_assistant_tokens_mask` needs)."""
    return bool(chat_template and _GENERATION_TAG.search(chat_template))


def assistant_spans(messages: list[dict], tokenizer, tools: list | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation rendered whole, [(start, end)] character spans of its assistant turns).

    Any chat template, with or without `{% generation %}` markers: turn i's span starts where
    the rendering of messages[:i] with the generation prompt ends, and ends where the
    rendering of messages[:i + 1] ends, cut after the turn's last EOS token (so ChatML's
    `<|im_end|>` is in the span and the newline after it is not). Both renderings must be
    prefixes of the whole one, as they are for a template that renders earlier turns the
    same whatever follows; ValueError otherwise (and without a chat template).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the rows are chat messages, but the tokenizer ({type(tokenizer).__name__}) has no "
                         "chat_template; set tokenizer.chat_template or give the rows as plain strings")
    render = _Renderer(tokenizer, tools)
    full = render(messages)
    eos = getattr(tokenizer, "eos_token", None) or ""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[:i + 1])
        if not (full.startswith(before) and full.startswith(through) and len(through) >= len(before)):
            raise ValueError(
                f"the chat template renders the conversation up to message {i} (an assistant turn) differently "
                "from the start of the whole conversation, so the assistant tokens cannot be located by "
                "position. The template rewrites earlier turns depending on what follows. Fix: use a training "
                "template that renders each prefix of a conversation as a prefix of the whole (set "
                "tokenizer.chat_template or SFTConfig.chat_template_path), or set assistant_only_loss=False.")
        end = len(through)
        if eos and (last := full.rfind(eos, len(before), end)) >= 0:
            end = last + len(eos)
        spans.append((len(before), end))
    return full, spans


# A conversation that uses every tool feature once, with markers a template cannot write by chance.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "align_probe_lookup", "description": "Looks up the value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key"}},
                   "required": ["key"]}}}]
PROBE = [
    {"role": "user", "content": "What is stored under q7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "align_probe_lookup", "arguments": {"key": "q7-probe-key"}}}]},
    {"role": "tool", "name": "align_probe_lookup", "content": "probe-result-5314"},
    {"role": "assistant", "content": "It is 5314."},
]
_PROBED: dict[str, str] = {}  # chat template text -> tool_template_problem's answer


def tool_template_problem(tokenizer) -> str:
    """'' if the tokenizer's chat template renders tool-calling conversations, else what it fails to show.

    Renders `PROBE` with and without `tools=PROBE_TOOLS`: the template must render without error, the tools
    must change the text (their schemas are shown), and the call's arguments and the tool's result must be
    in it. A template that ignores them would train the model on conversations with holes. Cached per
    template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return "it has no chat template" if template is None else ""
    if template not in _PROBED:
        _PROBED[template] = _probe(tokenizer)
    return _PROBED[template]


def _probe(tokenizer) -> str:
    try:
        with_tools = tokenizer.apply_chat_template(PROBE, tools=PROBE_TOOLS, tokenize=False)
        without = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except Exception as e:  # the template's own error (jinja2's TemplateError, a TypeError on None content, ...)
        return f"rendering a conversation with a tool call fails: {type(e).__name__}: {e}"
    missing = [what for what, ok in (("the tools=[...] schemas", with_tools != without),
                                     ("the assistant's tool_calls", "q7-probe-key" in with_tools),
                                     ("the tool message's content", "probe-result-5314" in with_tools)) if not ok]
    return f"it does not render {' nor '.join(missing)}" if missing else ""


def require_tool_template(tokenizer, model: str | None = None) -> None:
    """ValueError naming the model (`model`, else the tokenizer's name_or_path) when its chat template cannot
    render tool-calling conversations (`tool_template_problem`), with the fix."""
    why = tool_template_problem(tokenizer)
    if why:
        from stages.builtin.chat_templates import CHATML_TOOLS, TINY_TOOLS

        model = model or repr(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)
        raise ValueError(
            f"the data has tool calls (a 'tools' column, assistant tool_calls or tool messages), but the chat "
            f"template of {model} cannot render them: {why}. Training on it would drop the tools from the "
            "text. Fix: set chat_template_path (sft.chat_template_path in params, SFTConfig.chat_template_path, "
            "...) to a template that renders tools= and tool_calls; for a ChatML tokenizer (<|im_start|>, "
            f"<|im_end|>: SmolLM2, Qwen2) use align's {CHATML_TOOLS} (stages.builtin.chat_templates.CHATML_TOOLS), "
            f"for builtin:tiny {TINY_TOOLS} (TINY_TOOLS); or drop the tool columns and messages from the rows.")


def read_chat_template(path: str, tokenizer, owner: str) -> str:
    """The chat template `path` names (a .jinja/.j2 file, or a tokenizer folder whose template uses only special
    tokens `tokenizer` has); `owner` (the config's name) starts the messages."""
    source = Path(path).expanduser()
    if source.is_file():
        if source.suffix not in (".jinja", ".j2"):
            raise ValueError(f"{owner}.chat_template_path = {path!r}: a file must be a Jinja template (.jinja or "
                             ".j2); give such a file or a tokenizer folder")
        return source.read_text(encoding="utf-8")
    if not source.is_dir():
        raise ValueError(f"{owner}.chat_template_path = {path!r}: no such file or folder; give a .jinja/.j2 file "
                         "or a tokenizer folder (hub ids are not fetched by the trainers)")
    from transformers import AutoTokenizer

    donor = AutoTokenizer.from_pretrained(str(source))
    template = donor.chat_template
    if not isinstance(template, str):
        raise ValueError(f"{owner}.chat_template_path = {path!r}: the tokenizer there has no (single) chat "
                         "template; give a folder whose tokenizer has one, or a .jinja file")
    vocab = tokenizer.get_vocab()
    missing = [t for t in donor.all_special_tokens if t in template and t not in vocab]
    if missing:
        raise ValueError(f"{owner}.chat_template_path = {path!r}: the template uses special tokens {missing} that "
                         "the training tokenizer lacks; add them (tokenizer.add_special_tokens, then "
                         "model.resize_token_embeddings) and pass that tokenizer, or use a template of this "
                         "vocabulary")
    return template


def _messages(row: dict, r: _Renderer) -> dict:
    extra = {k: v for k, v in row.items() if k != "messages"}
    return {**extra, "text": r(row["messages"])}


def _prompt_only(row: dict, r: _Renderer) -> dict:
    if row["prompt"][-1]["role"] == "assistant":  # a reply to continue, not a turn to open
        return {**row, "prompt": r(row["prompt"], continue_final=True)}
    return {**row, "prompt": r(row["prompt"], generation_prompt=True)}


def _prompt_completion(row: dict, r: _Renderer) -> dict:
    prompt, completion = r.split(row["prompt"], row["completion"], "completion")
    return {**row, "prompt": prompt, "completion": completion}


def _preference(row: dict, r: _Renderer) -> dict:
    if "prompt" not in row:  # implicit prompt: each side is a whole conversation (as in TRL; extract it first
        return {**row, "chosen": r(row["chosen"]), "rejected": r(row["rejected"])}  # with maybe_extract_prompt)
    prompt, chosen = r.split(row["prompt"], row["chosen"], "chosen")
    _, rejected = r.split(row["prompt"], row["rejected"], "rejected")
    return {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}


# row kind (stages.data.formats.detect_format) -> renderer; unpaired rows render like prompt/completion
_RENDERERS = {
    "messages": _messages,
    "prompt_only": _prompt_only,
    "prompt_completion": _prompt_completion,
    "unpaired": _prompt_completion,
    "preference": _preference,
}


def unpair_preference_dataset(dataset, num_proc: int | None = None, desc: str | None = None):
    """Each prompt/chosen/rejected row -> two prompt/completion/label rows, chosen first.

    Takes a `datasets.Dataset` or `DatasetDict` (TRL's signature; `num_proc` and `desc` go
    to `map`) or a list of dicts, and returns the same type, with 2N rows for N:
    (prompt, chosen, label=True) then (prompt, rejected, label=False), row by row (TRL
    puts a whole map batch's chosen rows before its rejected ones); other columns are
    repeated on both. Rows without a prompt go through `maybe_extract_prompt`; one whose
    sides share nothing stays without a prompt (completion = the whole side), as in TRL.
    """
    if isinstance(dataset, list):
        return [out for row in dataset for out in _unpair(row)]

    def unpair_batch(batch: dict[str, list]) -> dict[str, list]:
        n = len(next(iter(batch.values())))
        rows = [out for i in range(n) for out in _unpair({k: v[i] for k, v in batch.items()})]
        return {k: [r.get(k) for r in rows] for k in rows[0]} if rows else {}

    columns = dataset.column_names
    if isinstance(columns, dict):  # a DatasetDict: {split: names}, the same in every split
        columns = next(iter(columns.values()))
    return dataset.map(unpair_batch, batched=True, remove_columns=columns, num_proc=num_proc, desc=desc)


def _unpair(row: dict[str, Any]) -> tuple[dict, dict]:
    row = maybe_extract_prompt(row)
    extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
    prompt = {"prompt": row["prompt"]} if "prompt" in row else {}
    return ({**extra, **prompt, "completion": row["chosen"], "label": True},
            {**extra, **prompt, "completion": row["rejected"], "label": False})
