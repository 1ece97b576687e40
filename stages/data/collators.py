"""Batching tokenised rows for causal-LM training: padded or padding-free, with loss masks.

`CompletionCollator` turns features (dicts of per-token lists) into `input_ids`, `labels` and `position_ids`
(B, T), plus `attention_mask` (B, T) for padded rows; with `padding_free=True`, B == 1 and there is no
attention mask. Labels are the token ids where the loss applies and IGNORE_INDEX elsewhere, decided by
positions (the `completion_mask` / `assistant_masks` columns), never by `ids != pad`: many tokenizers pad
with EOS, and the real EOS must be learnt.

Several sequences in one row are kept apart by `position_ids` that restart at 0 at each sequence and by
passing NO 2D attention mask: transformers then finds the sequence starts in position_ids and builds a
block-diagonal causal mask ("sdpa", "eager"; flash-attention turns them into sequence lengths). The detection
runs only without a KV cache: call the model with `use_cache=False` when training. The first token of every
packed sequence gets label IGNORE_INDEX, so no sequence is trained to predict the next one's start.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.losses import IGNORE_INDEX

__all__ = ["CompletionCollator"]


@dataclass
class CompletionCollator:
    """Pads (or concatenates) features into a causal-LM batch with labels from loss masks.

    Features: `input_ids` (n,), and optionally `completion_mask` (n,) and `assistant_masks`
    (n,) (1 where the loss applies), `labels` (n,) (TRL's prepared rows: IGNORE_INDEX where no
    loss, the token id elsewhere), and `seq_lengths` (k,) or `position_ids` (n,)
    describing several packed sequences in one feature (from `pack_dataset`).

    - completion_only_loss: loss only where `completion_mask` is 1 (all tokens if the
      feature has no completion_mask).
    - assistant_only_loss: loss only where `assistant_masks` is 1 (required then; get it
      from `tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)` with a
      template that marks assistant turns with `{% generation %}`). Both flags: both masks.
    - padding_free: all features concatenated into one row (1, sum n); no padding, no
      attention_mask.
    - max_length: each feature is truncated to its first max_length tokens first.
    - pad_to_multiple_of: the row length is rounded up to a multiple of it with padding.

    Output position_ids restart at 0 at every sequence start. Rows holding more than one
    sequence (padding_free, or packed features) get no attention_mask (see the module
    docstring); their padding forms its own trailing sequence with IGNORE_INDEX labels.
    """

    pad_token_id: int
    completion_only_loss: bool = True
    assistant_only_loss: bool = False
    padding_free: bool = False
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [self._row(i, f) for i, f in enumerate(features)]
        packed = self.padding_free or any(int(starts.sum()) > 1 for _, _, starts in rows)
        labelled = []
        for ids, keep, starts in rows:
            labels = torch.where(keep, ids, IGNORE_INDEX)
            if packed:
                labels[starts] = IGNORE_INDEX
            labelled.append((ids, labels, starts))
        if self.padding_free:
            ids, labels, starts = (torch.cat(parts) for parts in zip(*labelled, strict=True))
            labelled = [(ids, labels, starts)]
        return self._pad(labelled, packed)

    def _row(self, index: int, f: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (n,), loss mask (n,) bool, sequence starts (n,) bool) of one feature, truncated."""
        ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
        n = len(ids)
        keep = torch.ones(n, dtype=torch.bool)
        if self.completion_only_loss and f.get("completion_mask") is not None:
            keep &= self._mask(index, f, "completion_mask", n)
        if self.assistant_only_loss:
            if f.get("assistant_masks") is None:
                raise ValueError(f"feature {index} has no 'assistant_masks' but assistant_only_loss=True needs it; "
                                 f"found columns {sorted(f)}. Tokenise conversations with "
                                 "tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True, "
                                 "return_dict=True) using a chat template with {% generation %} markers, or set "
                                 "assistant_only_loss=False.")
            keep &= self._mask(index, f, "assistant_masks", n)
        if f.get("labels") is not None:
            keep &= self._labelled(index, f, ids)
        starts = _sequence_starts(index, f, n)
        if self.max_length is not None:
            ids, keep, starts = ids[:self.max_length], keep[:self.max_length], starts[:self.max_length]
        return ids, keep, starts

    @staticmethod
    def _mask(index: int, f: dict[str, Any], name: str, n: int) -> torch.Tensor:
        mask = torch.as_tensor(f[name]).bool()
        if mask.shape != (n,):
            raise ValueError(f"feature {index}: '{name}' has {tuple(mask.shape)} entries but 'input_ids' has {n}; "
                             "masks must have one entry per token (re-tokenise the row)")
        return mask

    @staticmethod
    def _labelled(index: int, f: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
        """(n,) bool: where a feature's `labels` are not IGNORE_INDEX; there they must be the input ids."""
        labels = torch.as_tensor(f["labels"], dtype=torch.long)
        if labels.shape != ids.shape:
            raise ValueError(f"feature {index}: 'labels' has {tuple(labels.shape)} entries but 'input_ids' has "
                             f"{len(ids)}; give one label per token ({IGNORE_INDEX} where no loss)")
        kept = labels != IGNORE_INDEX
        if (labels[kept] != ids[kept]).any():
            raise ValueError(f"feature {index}: 'labels' differ from 'input_ids' at positions "
                             f"{torch.nonzero(kept & (labels != ids)).flatten().tolist()[:10]}; labels mark where "
                             f"the loss applies (the token id there, {IGNORE_INDEX} elsewhere): the model learns "
                             "each next input token")
        return kept

    def _pad(self, rows: Sequence[tuple[torch.Tensor, ...]], packed: bool) -> dict[str, torch.Tensor]:
        """Rows of (ids, labels, starts), each (n_i,), into (B, T) tensors; T = max n_i rounded up."""
        width = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((batch, width), dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (ids, lab, starts) in enumerate(rows):
            n = len(ids)
            input_ids[i, :n], labels[i, :n], attention_mask[i, :n] = ids, lab, 1
            # padding is a sequence of its own (positions restart), so packed rows need no attention mask
            all_starts = torch.cat([starts, torch.arange(width - n) == 0])
            position_ids[i] = _positions(all_starts)
        out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if not packed:
            out["attention_mask"] = attention_mask
        return out


def _sequence_starts(index: int, f: dict[str, Any], n: int) -> torch.Tensor:
    """(n,) bool, True at the first token of each sequence in the feature.

    From `seq_lengths` if present, else from `position_ids` (a start wherever the position
    does not follow the previous one by 1, as transformers detects it), else one sequence.
    """
    starts = torch.zeros(n, dtype=torch.bool)
    if f.get("seq_lengths") is not None:
        lengths = torch.as_tensor(f["seq_lengths"], dtype=torch.long)
        if int(lengths.sum()) != n or (lengths < 1).any():
            raise ValueError(f"feature {index}: seq_lengths {lengths.tolist()} must be positive and sum to the "
                             f"{n} tokens of 'input_ids'")
        starts[torch.cumsum(lengths, 0) - lengths] = True
    elif f.get("position_ids") is not None:
        pos = torch.as_tensor(f["position_ids"], dtype=torch.long)
        if pos.shape != (n,):
            raise ValueError(f"feature {index}: 'position_ids' has {tuple(pos.shape)} entries but 'input_ids' "
                             f"has {n}")
        starts[1:] = pos[1:] != pos[:-1] + 1
    if n:
        starts[0] = True
    return starts


def _positions(starts: torch.Tensor) -> torch.Tensor:
    """0, 1, ... restarting at every True of starts: (n,) bool -> (n,) long."""
    index = torch.arange(len(starts))
    last_start = torch.cummax(torch.where(starts, index, 0), 0).values if len(starts) else index
    return index - last_start
