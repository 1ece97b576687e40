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

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from stages.group_packing import pack_groups
from stages.kernels import entropy_from_logits, selective_log_softmax
from stages.logprobs import causal_lm, head_logprobs, lm_head_for_chunking
from stages.sharding import unwrap
from stages.tensors import completion_mask_from_eos, pad
from stages.trainers.value_head import PreTrainedModelWrapper


def pad_rollout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *, pad_token_id: int,
                eos_token_id: int | Sequence[int], device: torch.device | str = "cpu", stop_at_eos: bool = True
                ) -> dict[str, torch.Tensor]:
    """B prompts and their B completions -> input_ids, attention_mask, completion_mask (see the module doc).

    Completions may carry tokens after their first EOS (e.g. from an external sampler); they
    are masked out. An empty completion has an all-zero mask row. stop_at_eos=False: every token of each
    completion is kept (multi-turn episodes, one EOS per turn).
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
    completion_mask = (completion_mask_from_eos(completions, eos_token_id) * within if stop_at_eos
                       else within.long())
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
                     with_entropy: bool = False, with_aux_loss: bool = False) -> dict[str, torch.Tensor]:
    """Per-token quantities of the completion tokens of a `pad_rollout` batch, each (B, C), float32.

    Returns {"logps": log p(token | prefix) under softmax(logits / temperature), 0 where
    completion_mask is 0; "entropy" with with_entropy; "values" when the model has a value head;
    "aux_loss", a Mixture-of-Experts model's load-balancing loss (a scalar), with with_aux_loss}.
    model: a causal LM, a PEFT model, or a `PreTrainedModelWrapper` (possibly DDP-wrapped).
    A head marked by `cast_lm_head_to_fp32` runs in float32 on either path, autocast or not.
    """
    input_ids, mask = batch["input_ids"], batch["completion_mask"]
    width = mask.shape[1]
    start = input_ids.shape[1] - width - 1  # hidden state at column P - 1 predicts completion token 0
    inputs = {"input_ids": input_ids, "attention_mask": batch["attention_mask"],
              "position_ids": position_ids(batch["attention_mask"]), "use_cache": False}
    if with_aux_loss:
        inputs["output_router_logits"] = True
    inner = unwrap(model)
    has_value = isinstance(inner, PreTrainedModelWrapper)
    head = lm_head_for_chunking(inner.pretrained_model if has_value else model) if chunked else None
    if with_aux_loss and has_value:
        raise ValueError("with_aux_loss: a model with a value head returns no load-balancing loss")
    aux_loss = None
    if has_value:
        logits, hidden, values = model(**inputs, return_logits=head is None)
    else:
        extra = {"logits_to_keep": 1} if head is not None else {}
        # the completions of one prompt as one row; not with a router loss, which would count the prompt once
        lm = causal_lm(model)
        packed = pack_groups(lm, batch, width) if head is not None and not with_aux_loss else None
        hidden, out = lm.hidden({**inputs, **packed.inputs(lm)} if packed else inputs, **extra)
        hidden = packed.unpack(hidden) if packed else hidden
        logits, values, aux_loss = out.logits, None, getattr(out, "aux_loss", None)
    window = slice(start, start + width)
    targets = input_ids[:, start + 1:]
    result: dict[str, torch.Tensor] = {}
    if with_aux_loss:
        if aux_loss is None:
            raise ValueError(f"with_aux_loss: {type(unwrap(model)).__name__} returned no aux_loss with "
                             "output_router_logits=True (not a Mixture-of-Experts model?)")
        result["aux_loss"] = aux_loss
    if head is not None:
        select = mask.bool()
        fp32 = getattr(head, FP32_HEAD, False)
        with torch.autocast(input_ids.device.type, enabled=False) if fp32 else contextlib.nullcontext():
            got = head_logprobs(hidden[:, window][select].float() if fp32 else hidden[:, window][select], head,
                                targets[select], temperature=temperature, return_entropy=with_entropy)
        got = got if with_entropy else (got,)
        for name, value in zip(("logps", "entropy"), got, strict=False):  # got: (logps,) without entropy
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


FP32_HEAD = "_align_fp32_head"  # set on an lm_head that `cast_lm_head_to_fp32` made float32


def cast_lm_head_to_fp32(model) -> None:
    """The language-model head of `model` in float32, computing from float32 hidden states even under autocast
    (ScaleRL; TRL's cast_lm_head_to_fp32). With tied embeddings the embedding output keeps the model's dtype.
    `completion_logps` honours it on its chunked path too (the head's matmul outside autocast)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cast_lm_head_to_fp32: {type(inner).__name__}'s output embeddings are "
                         f"{type(head).__name__}, not a plain Linear layer (a PEFT adapter on lm_head?); remove "
                         "lm_head from the adapter's target modules or set cast_lm_head_to_fp32: false")
    dtype = head.weight.dtype
    head.float()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return nn.functional.linear(hidden.float(), head.weight.float(),
                                        None if head.bias is None else head.bias.float())

    setattr(head, "forward", forward)  # noqa: B010 (an instance attribute shadowing the method, as TRL patches it)
    setattr(head, FP32_HEAD, True)
    embed = inner.get_input_embeddings()
    if embed is not None and embed.weight is head.weight:
        embed.register_forward_hook(lambda module, args, output: output.to(dtype))
