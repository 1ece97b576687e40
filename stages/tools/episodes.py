"""Multi-turn episodes: generate, parse the tool calls, run them, append the `tool` turns, generate again.

An episode is one prompt's completion grown turn by turn on token ids, never re-tokenised:

    prompt_ids      [<|im_start|>user ... <|im_start|>assistant\\n]
    completion_ids  [model turn 1 ... <|im_end|>] [\\n<|im_start|>tool ... <|im_start|>assistant\\n] [model turn 2 ...]
    tool_mask       [1 1 ... 1                 ] [0 0 ...                                     0] [1 1 ...          ]

`tool_mask` is 1 on the tokens the model sampled (they carry the loss and the log-probs) and 0 on the tool
outputs and the template's glue around them, which are context only. The glue comes from the chat template
itself (`tool_suffix_ids`, as TRL 1.16 builds it): the template must render earlier turns the same whatever
follows (prefix-preserving).

The loop (`run_episodes`) stops an episode at an answer without calls, at `max_iterations` rounds of tools
(TRL's `max_tool_calling_iterations`; the last turn's calls then stay unanswered), at a turn cut by the token
budget (no EOS: the template's tool turn could not follow it), or when the tool turns would push the completion
past `max_completion_length` (those turns are not added). A continuation is cut to what the budget has left.
Malformed calls are answered with parse-error turns (`stages.tools.runner`), so a bad call costs the model a
round, not the run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stages.tools.calls import ParsedTurn, parse_tool_calls
from stages.tools.runner import ToolRunner

# (contexts, n, round) -> len(contexts) * n completions, prompt-major: (token ids ending at the first EOS,
# the sampled tokens' log-probs or None)
Generate = Callable[[list[list[int]], int, int], list[tuple[list[int], list[float] | None]]]


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)  # 1: the model's token; 0: tool output / template glue
    logprobs: list[float] | None = None  # the sampler's, 0.0 on tool tokens; None when the sampler gave none
    messages: list[dict] = field(default_factory=list)  # assistant and tool turns, in order
    tool_rounds: int = 0

    def add(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None) -> None:
        self.completion_ids += list(ids)
        self.tool_mask += [mask] * len(ids)
        if self.logprobs is not None:
            self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    @property
    def answer(self) -> str:
        """The last assistant turn's text (what a string reward reads)."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m.get("content") or ""
        return ""


def tool_suffix_ids(tokenizer, tool_messages: list[dict], *, chat_template: str | None = None,
                    **template_kwargs) -> list[int]:
    """The token ids the template puts after an assistant turn's EOS: the tool turns, then the next assistant
    header. Found as TRL does, by rendering a short conversation with and without the tool turns."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kwargs = {"tokenize": True, "return_dict": False, "chat_template": chat_template, **template_kwargs}
    prefix = list(tokenizer.apply_chat_template(head, add_generation_prompt=False, **kwargs))
    full = list(tokenizer.apply_chat_template(head + tool_messages, add_generation_prompt=True, **kwargs))
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(prefix) if t == eos]
    if ends:  # the turn ends at EOS; what the template writes after it ("\n") belongs to the suffix
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')}'s chat template renders an "
                         "assistant turn differently once tool turns follow it (not prefix-preserving), so tool "
                         "outputs cannot be appended to a generated turn; use a template that renders earlier turns "
                         "unchanged, e.g. stages.builtin.chat_templates.CHATML_TOOLS")
    return full[len(prefix):]


def decode_turn(tokenizer, ids: Sequence[int], eos: Sequence[int]) -> str:
    """A generated turn's text without its closing EOS (other special tokens kept: they may be call markers)."""
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


def _generate_distinct(generate: Generate, contexts: list[list[int]], round_: int):
    """One completion per context. Equal contexts (the same call and result in several samples of a group) are
    generated together as one prompt with n = their count, so they continue differently, as independent samples
    would, while each context's samples stay a function of the seed and its tokens."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(contexts):
        groups.setdefault(tuple(c), []).append(i)
    by_count: dict[int, list[tuple[int, ...]]] = {}
    for key, members in groups.items():
        by_count.setdefault(len(members), []).append(key)
    out: list = [None] * len(contexts)
    for n, keys in by_count.items():
        got = generate([list(k) for k in keys], n, round_)
        for j, key in enumerate(keys):
            for k, i in enumerate(groups[key]):
                out[i] = got[j * n + k]
    return out


def run_episodes(prompt_ids: list[list[int]], generate: Generate, *, tokenizer, tools: list[dict],
                 runner: ToolRunner, fmt: str = "hermes", max_iterations: int | None = None,
                 max_completion_length: int, chat_template: str | None = None,
                 template_kwargs: dict | None = None) -> list[Episode]:
    """One episode per entry of `prompt_ids` (a group's prompts repeated, so equal prompts share their
    generation calls), each grown until it answers without a call or hits a limit.

    prompt_ids: N rendered prompts (the tools' schemas already in them).
    tools: N dicts {name: function}, each episode's tools (an environment's methods differ per episode).
    max_iterations: rounds of tool calls at most (None: no limit but the budget).
    """
    from stages.generation.common import eos_token_ids

    eos = eos_token_ids(tokenizer)
    if len(tools) != len(prompt_ids):
        raise ValueError(f"{len(tools)} tool sets for {len(prompt_ids)} episodes")
    episodes: list[Episode] = []
    for p, (ids, logps) in zip(prompt_ids, _generate_distinct(generate, prompt_ids, 0), strict=True):
        ep = Episode(list(p), logprobs=None if logps is None else [])
        ids = list(ids)[:max_completion_length]
        ep.add(ids, 1, None if logps is None else list(logps)[:max_completion_length])
        episodes.append(ep)
    turns = [parse_tool_calls(decode_turn(tokenizer, e.completion_ids, eos), fmt) for e in episodes]
    for ep, turn in zip(episodes, turns, strict=True):
        ep.messages.append(turn.message())
    limit = float("inf") if max_iterations is None else max_iterations
    active = [i for i, (e, t) in enumerate(zip(episodes, turns, strict=True)) if _continues(e, t, eos)]
    round_ = 0
    while active and round_ < limit:
        round_ += 1
        contexts, going = [], []
        for i in active:
            ep, turn = episodes[i], turns[i]
            results = [runner.call(tools[i], call) for call in turn.tool_calls]
            results += [runner.parse_error(err) for err in turn.errors]
            messages = [r.message() for r in results]
            suffix = tool_suffix_ids(tokenizer, messages, chat_template=chat_template, **(template_kwargs or {}))
            if len(ep.completion_ids) + len(suffix) >= max_completion_length:
                continue  # no room for the tool turns and an answer: the episode ends at its calls
            ep.messages += messages
            ep.add(suffix, 0, None)
            ep.tool_rounds += 1
            contexts.append(ep.prompt_ids + ep.completion_ids)
            going.append(i)
        nexts = _generate_distinct(generate, contexts, round_) if contexts else []
        active = []
        for i, (ids, logps) in zip(going, nexts, strict=True):
            ep = episodes[i]
            room = max_completion_length - len(ep.completion_ids)
            ids, logps = list(ids)[:room], None if logps is None else list(logps)[:room]
            ep.add(ids, 1, logps)
            turn = parse_tool_calls(decode_turn(tokenizer, ids, eos), fmt)
            turns[i] = turn
            ep.messages.append(turn.message())
            if _continues(ep, turn, eos):
                active.append(i)
    return episodes


def transcript(messages: list[dict]) -> str:
    """An episode's turns as readable text (completion logs): assistant text and calls, tool results."""
    import json

    lines = []
    for m in messages:
        if m["role"] == "tool":
            lines.append(f"[tool {m.get('name', '?')}] {m.get('content', '')}")
            continue
        text = m.get("content") or ""
        calls = [json.dumps(c["function"]) for c in m.get("tool_calls") or []]
        lines.append(" ".join([text, *(f"<call {c}>" for c in calls)]).strip())
    return "\n".join(lines)


def _continues(ep: Episode, turn: ParsedTurn, eos: Sequence[int]) -> bool:
    return turn.wants_tools and bool(ep.completion_ids) and ep.completion_ids[-1] in eos
