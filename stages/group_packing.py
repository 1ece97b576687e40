"""Completions that share a prompt, packed on it: one row per prompt instead of one per completion.

GRPO samples `num_generations` completions of every prompt, and its rollout batch
(`stages.trainers.rollout.pad_rollout`: the prompt left-padded to P columns, then the completion
right-padded to C) runs each prompt through the model once per completion. Packed, the rows of one
prompt become one row

    [ prompt | completion 1 | completion 2 | ... | completion G ]

with the position ids each token has in its own padded row (every completion continues from the
prompt's length) and an attention mask under which a completion sees the prompt and itself, never
another completion. Every token keeps exactly its padded context, so the hidden states are the same
(up to float rounding in the attention's reductions), and `PackedPairs.unpack` gathers them back into
the (B, P + C) padded layout: what follows the forward (the chunked log-probs of the completion
window) runs unchanged, and the gradients reach the prompt from every completion, as through G copies.
With a prompt of p tokens and G completions of c, the forward runs p + G·c tokens instead of G·(p + c).

Packing is used under the same conditions as pair packing (`stages.pair_packing`: a 4D-mask attention,
unsharded parameters, at least a tenth of the tokens saved, the sliding window respected, and the
first packed forward of each model checked against the padded one), else the padded rows run.
"""
from __future__ import annotations

import torch

from stages.logprobs import causal_lm
from stages.pair_packing import PackedPairs, packable, same_as_padded, worth_it

CHECK_ROWS = 4  # rows of the first prompt compared packed against padded on a model's first packed forward


def group_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int, pad_token_id: int = 0
                 ) -> PackedPairs | None:
    """Pack B rollout rows (prompt in columns [:T - width] left-padded, completion in the last `width` columns
    right-padded) per distinct prompt; None when no two rows share a prompt or the rows are not in that layout.

    Returns a PackedPairs whose `rows` (B,) and `index` (B, T) map every padded position to its packed one.
    """
    b, t = input_ids.shape
    p = t - width
    if p < 1 or b < 2:
        return None
    columns = torch.arange(t, device=input_ids.device)
    n_prompt = attention_mask[:, :p].sum(-1)
    n_completion = attention_mask[:, p:].sum(-1)
    expected = (columns >= p - n_prompt[:, None]) & ((columns < p) | (columns < p + n_completion[:, None]))
    if not bool((attention_mask.bool() == expected).all()) or not bool((n_prompt > 0).all()):
        return None  # holes in the mask: not the rollout layout
    keys = torch.cat([input_ids[:, :p] * attention_mask[:, :p], attention_mask[:, :p]], 1)
    prompts, group = torch.unique(keys, dim=0, return_inverse=True)
    if prompts.shape[0] == b:
        return None
    groups = [torch.nonzero(group == g).flatten().tolist() for g in range(prompts.shape[0])]
    lengths = [int(n_prompt[rows[0]]) + sum(int(n_completion[r]) for r in rows) for rows in groups]
    packed_width = max(lengths)
    dump = packed_width  # padding goes to an extra column, dropped below (then position 0 in `index`)
    ids = torch.full((len(groups), packed_width + 1), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    positions = torch.zeros((len(groups), packed_width + 1), dtype=torch.long, device=input_ids.device)
    member = torch.full((len(groups), packed_width), -2, dtype=torch.long, device=input_ids.device)  # -2: padding
    index = torch.full((b, t), dump, dtype=torch.long, device=input_ids.device)
    rows = torch.empty(b, dtype=torch.long, device=input_ids.device)
    for g, members in enumerate(groups):
        n_p = int(n_prompt[members[0]])
        ids[g, :n_p] = input_ids[members[0], p - n_p:p]
        positions[g, :n_p] = torch.arange(n_p)
        member[g, :n_p] = -1  # the prompt: seen by every completion
        offset = n_p
        for k, r in enumerate(members):
            n_c = int(n_completion[r])
            rows[r] = g
            index[r, p - n_p:p] = torch.arange(n_p)
            index[r, p:p + n_c] = torch.arange(offset, offset + n_c)
            ids[g, offset:offset + n_c] = input_ids[r, p:p + n_c]
            positions[g, offset:offset + n_c] = torch.arange(n_p, n_p + n_c)
            member[g, offset:offset + n_c] = k
            offset += n_c
    j = torch.arange(packed_width, device=input_ids.device)
    valid = member > -2
    mask = (j[None, :, None] >= j[None, None, :]) & valid[:, :, None] & valid[:, None, :]
    mask &= (member[:, None, :] == -1) | (member[:, :, None] == member[:, None, :])  # a completion sees no other
    mask |= torch.eye(packed_width, dtype=torch.bool, device=input_ids.device) & ~valid[:, :, None]
    index = index.masked_fill(index == dump, 0)
    return PackedPairs(ids[:, :packed_width], positions[:, :packed_width], mask[:, None], rows, index)


def pack_groups(model, batch: dict[str, torch.Tensor], width: int) -> PackedPairs | None:
    """The rollout `batch` (input_ids, attention_mask) packed per prompt for `model`, or None when the padded
    rows should run (see the module doc). `model`: a module or a `stages.logprobs.CausalLM`."""
    lm = causal_lm(model)
    if not packable(lm):
        return None
    packed = group_layout(batch["input_ids"], batch["attention_mask"], width)
    if not worth_it(lm, packed, batch["input_ids"]):
        return None
    assert packed is not None
    first = torch.nonzero(packed.rows == packed.rows[0]).flatten()[:CHECK_ROWS]
    attention = batch["attention_mask"][first]
    sample = {"input_ids": batch["input_ids"][first], "attention_mask": attention,
              "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}  # left padding shifts no position
    check = group_layout(sample["input_ids"], sample["attention_mask"], width)
    if check is None or not same_as_padded(lm, sample, check):
        return None
    return packed
