"""What `stages.trainers.online_options`' settings do at run time (RLOO, on-policy distillation).

`PromptBatchSampler` (shuffle_dataset, and each optimizer step's batches repeated num_iterations times),
`pad_to_multiple` (pad_to_multiple_of) and `completion_sample` (log_completions). Dropout, TR-DPO's reference
sync and waiting for a vLLM server are every trainer's (`inputs.disable_dropout`, `ref_sync`,
`online_generation.wait_for_server`).
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from stages.data.templates import require_tool_template
from stages.data.tool_calls import parsed_messages, tool_schemas

logger = logging.getLogger(__name__)


class PromptBatchSampler(torch.utils.data.Sampler):
    """Batches of row indices, shuffled per epoch (or in dataset order); each run of `group` batches (one optimizer
    step's) is yielded `repeats` times in a row, so the updates of one generation see the same prompts."""

    def __init__(self, num_rows: int, batch_size: int, *, group: int, repeats: int, seed: int, shuffle: bool = True):
        self.num_rows, self.batch_size, self.group, self.repeats = num_rows, batch_size, group, repeats
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = (torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
                 if self.shuffle else torch.arange(self.num_rows))
        batches = [order[i:i + self.batch_size].tolist() for i in range(0, self.num_rows, self.batch_size)]
        for start in range(0, len(batches), self.group):
            for _ in range(self.repeats):
                yield from batches[start:start + self.group]

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.batch_size) * self.repeats


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int | str | None, pad_token_id: int
                    ) -> dict[str, torch.Tensor]:
    """A rollout batch (`stages.trainers.rollout.pad_rollout`) with its prompt part left-padded and its completion
    part right-padded to widths that are multiples of `multiple` ("auto" or None: unchanged). Every (B, C) tensor
    is padded with zeros; the masks keep the new columns out of attention and of the loss."""
    if multiple in ("auto", None):
        return batch
    assert isinstance(multiple, int)
    width = batch["completion_mask"].shape[1]
    prompt = batch["input_ids"].shape[1] - width
    left, right = -prompt % multiple, -width % multiple
    if not left and not right:
        return batch
    out = {}
    for key, value in batch.items():
        if value.dim() == 2 and value.shape[1] == prompt + width:
            fill = pad_token_id if key == "input_ids" else 0
            out[key] = nn.functional.pad(value, (left, right), value=fill)
        elif value.dim() == 2 and value.shape[1] == width:
            out[key] = nn.functional.pad(value, (0, right), value=0)
        else:
            out[key] = value
    return out


def render_prompts(tokenizer, prompts: list, chat_template_kwargs: dict | None, tools: list | None = None) -> list:
    """Prompts for the sampler: with chat_template_kwargs, or tools, each conversational prompt (a message list)
    rendered here with the chat template, its generation prompt (or, ending in an assistant message, continued),
    those keyword arguments and its row's tools
    (`tools`: one `tools` column value per prompt, None where a row has none; a template that cannot show them
    is refused, `stages.data.templates.require_tool_template`); a string prompt is left as it is. Without
    either, the prompts unchanged (the sampler applies the template's defaults)."""
    tools = tools if tools is not None else [None] * len(prompts)
    if not chat_template_kwargs and not any(tools):
        return list(prompts)
    out = []
    for prompt, row_tools in zip(prompts, tools, strict=True):
        if isinstance(prompt, list):
            if row_tools:
                require_tool_template(tokenizer)
                prompt = parsed_messages(prompt)
            cont = bool(prompt) and prompt[-1].get("role") == "assistant"  # a prefilled answer is continued
            prompt = tokenizer.apply_chat_template(prompt, tools=tool_schemas(row_tools), tokenize=False,
                                                   add_generation_prompt=not cont, continue_final_message=cont,
                                                   **(chat_template_kwargs or {}))
        out.append(prompt)
    return out


def completion_sample(prompts: list, completions: list[str], rewards: list[float | None], *, limit: int | None,
                      unique_prompts: bool) -> list[dict]:
    """The rows log_completions prints: one per completion (or per prompt with unique_prompts), at most `limit`."""
    rows, seen = [], set()
    for prompt, completion, reward in zip(prompts, completions, rewards, strict=True):
        key = str(prompt)
        if unique_prompts and key in seen:
            continue
        seen.add(key)
        rows.append({"prompt": prompt, "completion": completion, "reward": reward})
    return rows[:limit] if limit is not None else rows


def log_completion_sample(rows: list[dict], step: int) -> None:
    for row in rows:
        logger.info("step %d | prompt %r | completion %r | reward %s", step, row["prompt"], row["completion"],
                    row["reward"])
