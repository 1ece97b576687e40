"""Evaluate's answers through tools (stages.pipeline.tool_answers): one episode per held-out row on every backend,
the answer read from the last turn, after the tool's result."""
import json
import re

import pytest

from stages.builtin import arithmetic_tools, tiny
from stages.builtin.chat_templates import TINY_TOOLS
from stages.generation import SamplingParams, generate
from stages.pipeline.tool_answers import ToolSettings, answer_with_tools
from stages.tools.episodes import decode_turn
from tests.stages.generation.test_vllm import FakeVLLM, choice

ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{b}"}], "tools": [arithmetic_tools.ADD_SCHEMA]}
        for a, b in [(47, 85), (3, 4), (10, 90)]]
SETTINGS = ToolSettings([arithmetic_tools.add], max_tool_calling_iterations=1, tool_timeout=5.0,
                        tool_mode="in_process", max_completion_length=96)


@pytest.fixture(scope="module")
def tiny_tools(tmp_path_factory):
    """The built-in tiny model (untrained) and its tokenizer with TINY_TOOLS."""
    from stages.models import load_causal_lm, load_tokenizer

    path = tiny.build(tmp_path_factory.mktemp("tools-tiny"), hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, vocab_size=384, seed=0)
    tok = load_tokenizer(str(path))
    tok.chat_template = TINY_TOOLS.read_text()
    return path, load_causal_lm(str(path)), tok


def calculator_user(tok, wrong_by: int = 0):
    """A scripted model behind the server: calls add with the user's operands; after the tool's turn, answers
    the result (plus `wrong_by`). Each reply as token ids ending at EOS, as vLLM gives them."""
    eos = tok.eos_token_id

    def respond(body):
        text = tok.decode(body["prompt"])
        result = re.search(r"\n(-?\d+)<\|end\|><\|assistant\|>\n$", text)
        if result:
            reply = str(int(result.group(1)) + wrong_by)
        else:
            a, b = re.findall(r"<\|user\|>\n(\d+)\+(\d+)", text)[-1]
            arguments = json.dumps({"a": int(a), "b": int(b)})
            reply = '<tool_call>{"name": "add", "arguments": ' + arguments + "}</tool_call>"
        return [choice(tok, 0, tok(reply, add_special_tokens=False)["input_ids"] + [eos], "stop")]

    return respond


def test_through_a_server_the_answer_is_the_last_turn_after_the_tool(tiny_tools):
    path, _, tok = tiny_tools
    greedy = SamplingParams(max_new_tokens=96, backend="vllm")
    with FakeVLLM(str(path), calculator_user(tok)) as server:
        got = answer_with_tools(str(path), tok, ROWS, greedy, SETTINGS, batch_size=2, model_name="m",
                                base_url=server.url)
    assert got.answers == ["132", "7", "100"] and got.calls == 3
    assert got.transcripts[0] == '<call {"name": "add", "arguments": {"a": 47, "b": 85}}>\n[tool add] 132\n132'
    with FakeVLLM(str(path), calculator_user(tok, wrong_by=1)) as server:  # the tool's result, not the call, counts
        wrong = answer_with_tools(str(path), tok, ROWS, greedy, SETTINGS, batch_size=2, model_name="m",
                                  base_url=server.url)
    assert wrong.answers == ["133", "8", "101"]
    # the server saw each episode's context as token ids: the prompt rendered with the tools, then the call and
    # the tool's turn
    bodies = [b["prompt"] for _, b in server.requests]
    assert len(bodies) == 6 and all(tok.decode(b).startswith("<|system|>\ntools: add(a, b)<|end|>") for b in bodies)


@pytest.mark.parametrize("backend", ["hf", "decoder"])
def test_in_process_a_model_that_never_calls_answers_as_plain_generation(tiny_tools, backend):
    """The untrained model makes no call: each episode is one turn, the same tokens greedy generation gives, on
    HF generate and on the CPU decoder (both take the episode's token ids as they are)."""
    _, model, tok = tiny_tools
    greedy = SamplingParams(max_new_tokens=12, backend=backend)
    got = answer_with_tools(model, tok, ROWS, greedy, SETTINGS, batch_size=2, model_name="m")
    plain = generate(model, tok, [r["prompt"] for r in ROWS], greedy, tools=[r["tools"] for r in ROWS])
    assert got.calls == 0 and got.lengths == [len(ids) for ids in plain.completion_ids]
    eos = [tok.eos_token_id]
    assert got.answers == [decode_turn(tok, ids, eos).strip() for ids in plain.completion_ids]
