"""generate(..., tools=): each prompt rendered with its row's tools (the pipeline's score and evaluate pass the
`tools` column of prompt rows); a template that cannot show them is refused; one tools value per prompt."""
from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.builtin.chat_templates import CHATML_TOOLS
from stages.generation import SamplingParams, generate
from tests import architectures

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = architectures.qwen2(tmp_path_factory.mktemp("qwen2"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_prompts_are_rendered_with_their_tools(qwen2):
    model, tok = qwen2
    tok.chat_template = CHATML_TOOLS.read_text()
    prompts = [[{"role": "user", "content": "2+3?"}]] * 2
    gens = generate(model, tok, prompts, SamplingParams(max_new_tokens=2), backend="hf", tools=[[ADD], None])
    with_tools, without = (tok.decode(ids) for ids in gens.prompt_ids)
    assert with_tools == tok.apply_chat_template(prompts[0], tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in with_tools and '"name": "add"' not in without
    assert without == tok.apply_chat_template(prompts[1], tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="tools has 1 entries for 2 prompts"):
        generate(model, tok, prompts, SamplingParams(max_new_tokens=2), backend="hf", tools=[[ADD]])


def test_a_template_that_cannot_show_the_tools_is_refused(qwen2):
    model, tok = qwen2
    tok.chat_template = architectures.CHATML
    with pytest.raises(ValueError, match="cannot render them"):
        generate(model, tok, [[{"role": "user", "content": "2+3?"}]], SamplingParams(max_new_tokens=2),
                 backend="hf", tools=[[ADD]])
