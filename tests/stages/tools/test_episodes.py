"""stages.tools.episodes on a tiny model taught to call tools (tests/tool_model.py): the episode's tokens, its
mask token by token, the loop's limits and the fault counts."""
import pytest

from stages.generation import SamplingParams, generate
from stages.tools import ToolRunner
from stages.tools.episodes import _generate_distinct, run_episodes, tool_suffix_ids, transcript
from stages.trainers.tool_rollout import token_prompts
from tests import tool_model as tm
from tests.tool_model import tool_model  # noqa: F401 (the session fixture)


@pytest.fixture(scope="module")
def loaded(tool_model):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tool_model), AutoTokenizer.from_pretrained(tool_model)


def greedy(model, tok, max_new_tokens=24):
    def gen(contexts, n, round_):
        gens = generate(model, tok, token_prompts(tok, contexts),
                        SamplingParams(max_new_tokens=max_new_tokens, n=n, do_sample=n > 1, seed=round_))
        return list(zip(gens.completion_ids, gens.logprobs or [None] * len(gens), strict=True))
    return gen


def prompt_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tools=tm.TOOLS, tokenize=False,
                                       add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def episodes(loaded, prompts, *, runner=None, **kw):
    model, tok = loaded
    ids = [prompt_ids(tok, p) for p in prompts]
    tools = {f.__name__: f for f in tm.TOOLS}
    kw = {"max_completion_length": 64, **kw}
    return run_episodes(ids, greedy(model, tok), tokenizer=tok, tools=[tools] * len(ids),
                        runner=runner or ToolRunner(timeout=1.0), **kw)


def test_the_mask_is_one_on_the_model_tokens_and_zero_on_the_tool_turn(loaded):
    _, tok = loaded
    (ep,) = episodes(loaded, ["Add 2 and 3."])
    first = tok('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
                add_special_tokens=False)["input_ids"]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    answer = tok("5<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ep.completion_ids == first + suffix + answer
    assert ep.tool_mask == [1] * len(first) + [0] * len(suffix) + [1] * len(answer)
    assert tok.decode(suffix) == ("\n<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n"
                                  "<|im_start|>assistant\n")
    masked = [tok.decode([t]) for t, m in zip(ep.completion_ids, ep.tool_mask, strict=True) if m == 0]
    assert "".join(masked) == tok.decode(suffix) and sum(ep.tool_mask) == len(first) + len(answer)
    print(f"masked tokens: {len(suffix)} of {len(ep.completion_ids)} (model tokens {sum(ep.tool_mask)})")
    # the concatenated ids are exactly the template's rendering of the whole conversation
    whole = tok.apply_chat_template([{"role": "user", "content": "Add 2 and 3."}, *ep.messages], tools=tm.TOOLS,
                                    tokenize=True, return_dict=False)
    assert ep.prompt_ids + ep.completion_ids == whole[:len(ep.prompt_ids) + len(ep.completion_ids)]
    assert whole[len(ep.prompt_ids) + len(ep.completion_ids):] == tok("\n", add_special_tokens=False)["input_ids"]
    assert ep.messages[1:] == [{"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "5"}]
    assert ep.answer == "5" and ep.tool_rounds == 1
    assert transcript(ep.messages).splitlines() == ['<call {"name": "add", "arguments": {"a": 2, "b": 3}}>',
                                                    "[tool add] 5", "5"]


def test_faults_are_answered_and_counted_and_every_episode_ends_with_an_answer(loaded):
    runner = ToolRunner(timeout=1.0)
    eps = episodes(loaded, ["Use boom.", "Use hang.", "Bad call.", "Add 2 and 3."], runner=runner)
    assert runner.take_counts() == {"calls": 4, "errors": 1, "timeouts": 1, "parse_errors": 1}
    assert [e.answer for e in eps] == ["failed", "failed", "failed", "5"]
    tool_turns = [e.messages[1] for e in eps]
    assert [t["name"] for t in tool_turns] == ["boom", "hang", "invalid_tool_call", "add"]
    assert '"RuntimeError: boom"' in tool_turns[0]["content"] and "timed out" in tool_turns[1]["content"]
    assert "could not parse the tool call" in tool_turns[2]["content"]
    assert "<tool_call>" in eps[2].messages[0]["content"]  # the malformed call stays in the transcript


def test_limits_no_rounds_and_no_room(loaded):
    runner = ToolRunner()
    (ep,) = episodes(loaded, ["Add 2 and 3."], runner=runner, max_iterations=0)
    assert ep.tool_rounds == 0 and set(ep.tool_mask) == {1} and len(ep.messages) == 1
    assert ep.messages[0]["tool_calls"] and runner.take_counts()["calls"] == 0  # the call stays unanswered
    (ep,) = episodes(loaded, ["Add 2 and 3."], runner=runner, max_completion_length=len(ep.completion_ids) + 3)
    assert ep.tool_rounds == 0 and len(ep.messages) == 1  # the tool turn would not fit: not added


def test_equal_contexts_are_sampled_together():
    calls = []

    def gen(contexts, n, round_):
        calls.append((contexts, n))
        return [([len(calls), k], None) for _ in contexts for k in range(n)]

    out = _generate_distinct(gen, [[1], [2], [1], [3], [2], [1]], 0)
    assert sorted(calls) == [([[1]], 3), ([[2]], 2), ([[3]], 1)]
    assert len({tuple(ids) for ids, _ in out}) == 6  # every context got its own sample
