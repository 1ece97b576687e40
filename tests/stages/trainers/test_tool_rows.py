"""Tool-calling rows in the trainers: SFT trains on them (2 steps, a ChatML Qwen2 with align's CHATML_TOOLS
template, assistant-only loss) with the calls and answers as the only targets; a model whose template cannot
render tools is refused before training, naming it; DPO and KTO rows render their tools and calls."""
from __future__ import annotations

import json

import datasets
import pytest
import torch

from stages.builtin.chat_templates import CHATML_TOOLS
from stages.trainers.kto_trainer import tokenize_unpaired
from stages.trainers.pair_batches import tokenize_pairs
from stages.trainers.sft_trainer import SFTConfig, SFTTrainer
from tests import architectures

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def call(name: str, a: int, b: int) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}


def conversation(i: int, name: str = "add") -> list[dict]:
    answer = str(i + 1 if name == "add" else i * 2)
    return [{"role": "user", "content": f"{i} {'+ 1' if name == 'add' else '* 2'}?"},
            call(name, i, 1 if name == "add" else 2), {"role": "tool", "name": name, "content": answer},
            {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return str(architectures.qwen2(tmp_path_factory.mktemp("qwen2")))


def args(tmp_path, **kw) -> SFTConfig:
    return SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                     max_length=1024, seed=0, **kw)


def test_sft_trains_on_tool_calls_and_answers_only(qwen2, tmp_path):
    """Rows: `messages` with a tools column (a list, a JSON string, and Python functions in the API). The labels
    the collator builds are exactly the assistant's calls and answers; 2 steps move every weight."""
    rows = [{"messages": conversation(i), "tools": [ADD] if i % 2 else json.dumps([ADD])} for i in range(6)]
    rows += [{"messages": conversation(i, "multiply"), "tools": [multiply]} for i in range(2)]
    trainer = SFTTrainer(qwen2, args=args(tmp_path, chat_template_path=str(CHATML_TOOLS), assistant_only_loss=True),
                         train_dataset=rows)
    tok = trainer.processing_class
    row = next(r for r in trainer.train_dataset if '"name": "multiply"' in tok.decode(r["input_ids"]))
    text = tok.decode(row["input_ids"])
    assert '"description": "Multiply two integers."' in text  # the function's schema, from its docstring
    labels = trainer.data_collator([row])["labels"][0]
    i = int(text.split("<|im_start|>user\n")[1].split(" ")[0])
    assert tok.decode(labels[labels != -100]) == (
        f'<tool_call>{{"name": "multiply", "arguments": {{"a": {i}, "b": 2}}}}</tool_call><|im_end|>{i * 2}<|im_end|>')
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]


def test_a_dataset_with_json_string_tools_and_arguments_renders_like_lists(qwen2, tmp_path):
    """A datasets.Dataset merges the fields of differing schemas (Arrow structs); JSON strings keep them exact, and
    render as the objects they hold."""
    as_lists = [{"messages": conversation(3), "tools": [ADD]}]
    as_strings = [{"messages": [{**m, "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": json.dumps({"a": 3, "b": 1})}}]} if m.get("tool_calls") else m
        for m in conversation(3)], "tools": json.dumps([ADD])}]
    a = args(tmp_path, chat_template_path=str(CHATML_TOOLS), assistant_only_loss=True)
    first = SFTTrainer(qwen2, args=a, train_dataset=as_lists).train_dataset[0]
    second = SFTTrainer(qwen2, args=a, train_dataset=datasets.Dataset.from_list(as_strings)).train_dataset[0]
    assert first["input_ids"] == second["input_ids"] and first["assistant_masks"] == second["assistant_masks"]


def test_a_template_that_cannot_render_tools_is_refused_before_training(qwen2, tmp_path):
    with pytest.raises(ValueError, match=r"chat template of '" + qwen2 + r"' cannot render them: .*Fix: set "
                                         r"chat_template_path .*chatml_tools\.jinja"):
        SFTTrainer(qwen2, args=args(tmp_path), train_dataset=[{"messages": conversation(1), "tools": [ADD]}])


@pytest.fixture(scope="module")
def chatml_tools():
    return architectures.train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                                         chat_template=CHATML_TOOLS.read_text())


def test_preference_rows_render_tools_and_calls(chatml_tools):
    """DPO: the prompt holds the tools; the chosen side the call, its result and the answer; the rejected side a
    wrong answer without the tool."""
    tok = chatml_tools
    conv = conversation(4)
    rows = [{"prompt": conv[:1], "chosen": conv[1:], "rejected": [{"role": "assistant", "content": "6"}],
             "tools": [ADD]}]
    pair = tokenize_pairs(tok, rows, max_length=1024)[0]
    chosen = tok.decode(pair["chosen_input_ids"])
    prompt = tok.decode([i for i, m in zip(pair["chosen_input_ids"], pair["chosen_completion_mask"], strict=True)
                         if not m])
    assert '"name": "add", "description": "Add two integers."' in prompt and prompt.endswith("assistant\n")
    assert chosen[len(prompt):] == ('<tool_call>{"name": "add", "arguments": {"a": 4, "b": 1}}</tool_call><|im_end|>\n'
                                    '<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n'
                                    '<|im_start|>assistant\n5<|im_end|>\n')
    rejected = tok.decode(pair["rejected_input_ids"])
    assert rejected.startswith(prompt) and rejected[len(prompt):] == "6<|im_end|>\n"


def test_unpaired_rows_render_tools_and_calls(chatml_tools):
    tok = chatml_tools
    conv = conversation(2)
    out = tokenize_unpaired(tok, [{"prompt": conv[:1], "completion": conv[1:2], "label": True, "tools": [ADD]},
                                  {"prompt": conv[:1], "completion": [{"role": "assistant", "content": "9"}],
                                   "label": False, "tools": [ADD]}], max_length=1024)
    assert '"description": "Add two integers."' in tok.decode(out[0]["prompt_ids"])
    assert tok.decode(out[0]["completion_ids"]) == ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 1}}'
                                                    '</tool_call><|im_end|>\n')


def test_online_prompts_are_rendered_with_their_rows_tools(chatml_tools):
    """What RLOO, online DPO and distillation hand their sampler: a prompt row's tools in its rendering; prompts
    without tools, and plain strings, as they were."""
    from stages.trainers.online_extras import render_prompts

    tok = chatml_tools
    prompts = [conversation(1)[:1], conversation(2)[:1], "3 + 1 ="]
    out = render_prompts(tok, prompts, None, [[ADD], None, None])
    assert out[0] == tok.apply_chat_template(prompts[0], tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in out[0] and out[0].endswith("<|im_start|>assistant\n")
    assert out[1] == tok.apply_chat_template(prompts[1], tokenize=False, add_generation_prompt=True)
    assert out[2] == "3 + 1 ="
    assert render_prompts(tok, prompts, None, [None, None, None]) == prompts  # no tools: the sampler renders
    plain = architectures.train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                                          chat_template=architectures.CHATML)
    with pytest.raises(ValueError, match="cannot render them"):
        render_prompts(plain, prompts, None, [[ADD], None, None])
