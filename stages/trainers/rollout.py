"""Rollout tensors shared by the on-policy trainers (PPO, GRPO): padding and per-token log-probs.

`pad_rollout` turns prompt ids + completion ids (lists, as `stages.generation.Generations`
holds them) into one batch: the prompt left-padded, the completion right-padded, so every
completion starts at column P (the prompt width):

    input_ids       (B, P + C)   [pad pad p p p | c c c EOS pad pad]
    attention_mask  (B, P + C)   0 on padding and on anything after the first EOS
    completion_mask (B, C)       1 on completion tokens up to and including the first EOS

The completion mask comes from each completion's length and the position of its first EOS,
never from `ids != pad_token_id` (the pad id is often the EOS id).

`completion_logps` runs the model over such a batch and returns the log-probs of the
completion tokens (B, C), optionally their entropies and, for a model with a value head
(`stages.trainers.value_head`), the values V(s_t) of the states before each completion token.
Position t's log-prob and value both come from the hidden state at column P + t - 1.
The completions of one prompt run as one row packed on that prompt where the model allows
(`stages.group_packing`), with the same log-probs.
`sampler_logps` lays the sampler's own log-probs (`Generations.logprobs`) out the same way, for
the off-policy correction.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.group_packing import pack_groups
from stages.kernels import entropy_from_logits, selective_log_softmax
from stages.logprobs import final_hidden, head_logprobs, lm_head_for_chunking
from stages.sharding import unwrap
from stages.tensors import completion_mask_from_eos, pad
from stages.trainers.value_head import PreTrainedModelWrapper


def pad_rollout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *, pad_token_id: int,
                eos_token_id: int | Sequence[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """B prompts and their B completions -> input_ids, attention_mask, completion_mask (see the module doc).

    Completions may carry tokens after their first EOS (e.g. from an external sampler); they
    are masked out. An empty completion has an all-zero mask row.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions: pass one prompt per "
                         "completion (repeat prompt_ids by Generations.prompt_index)")
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} has no tokens; a causal LM needs at least one prompt token")
    prompts = pad([torch.tensor(list(p), dtype=torch.long) for p in prompt_ids], pad_token_id, "left")
    prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], 0, "left")
    width = max([len(c) for c in completion_ids] + [1])  # >= 1 column even when every completion is empty
    completions = torch.full((len(completion_ids), width), pad_token_id, dtype=torch.long)
    for i, c in enumerate(completion_ids):
        completions[i, :len(c)] = torch.tensor(list(c), dtype=torch.long)
    lengths = torch.tensor([len(c) for c in completion_ids])
    within = torch.arange(completions.shape[1])[None, :] < lengths[:, None]
    completion_mask = completion_mask_from_eos(completions, eos_token_id) * within
    return {
        "input_ids": torch.cat([prompts, completions], 1).to(device),
        "attention_mask": torch.cat([prompt_mask, completion_mask], 1).to(device),
        "completion_mask": completion_mask.to(device),
    }


def sampler_logps(logprobs: list[list[float]], width: int) -> torch.Tensor:
    """`Generations.logprobs` as a (B, width) float32 tensor aligned with a completion_tensors batch; 0 on padding."""
    out = torch.zeros(len(logprobs), width, dtype=torch.float32)
    for i, row in enumerate(logprobs):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over the attended tokens only (0 at each row's first real token): (B, T).

    Left padding must not shift positions, or the log-probs would differ from those the
    sampler (which computes positions the same way) produced.
    """
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def completion_logps(model, batch: dict[str, torch.Tensor], *, temperature: float = 1.0, chunked: bool = True,
                     with_entropy: bool = False) -> dict[str, torch.Tensor]:
    """Per-token quantities of the completion tokens of a `pad_rollout` batch, each (B, C), float32.

    Returns {"logps": log p(token | prefix) under softmax(logits / temperature), 0 where
    completion_mask is 0; "entropy" with with_entropy; "values" when the model has a value head}.
    model: a causal LM, a PEFT model, or a `PreTrainedModelWrapper` (possibly DDP-wrapped).
    """
    input_ids, mask = batch["input_ids"], batch["completion_mask"]
    width = mask.shape[1]
    start = input_ids.shape[1] - width - 1  # hidden state at column P - 1 predicts completion token 0
    inputs = {"input_ids": input_ids, "attention_mask": batch["attention_mask"],
              "position_ids": position_ids(batch["attention_mask"]), "use_cache": False}
    inner = unwrap(model)
    has_value = isinstance(inner, PreTrainedModelWrapper)
    head = lm_head_for_chunking(inner.pretrained_model if has_value else model) if chunked else None
    if has_value:
        logits, hidden, values = model(**inputs, return_logits=head is None)
    else:
        extra = {"logits_to_keep": 1} if head is not None else {}
        packed = pack_groups(model, batch, width) if head is not None else None  # completions of one prompt
        hidden, out = final_hidden(model, {**packed.inputs(model), "use_cache": False} if packed else inputs, **extra)
        hidden = packed.unpack(hidden) if packed else hidden
        logits, values = out.logits, None
    window = slice(start, start + width)
    targets = input_ids[:, start + 1:]
    result = {}
    if head is not None:
        select = mask.bool()
        got = head_logprobs(hidden[:, window][select], head, targets[select], temperature=temperature,
                            return_entropy=with_entropy)
        got = got if with_entropy else (got,)
        for name, value in zip(("logps", "entropy"), got):
            result[name] = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(
                select, value.float())
    else:
        scaled = logits[:, window].float() / temperature
        result["logps"] = selective_log_softmax(scaled, targets).float() * mask
        if with_entropy:
            result["entropy"] = entropy_from_logits(scaled).float() * mask
    if has_value:
        result["values"] = values[:, window].float() * mask
    return result
