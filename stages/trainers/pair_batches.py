"""Preference pairs as the trainers see them: tokenisation, collation and sequence log-probs.

Shared by DPO, online DPO, KTO, GRPO's reward head, the reward trainer and the pipeline's
`reference` stage. A pair row holds chosen_input_ids / chosen_completion_mask and the same for
rejected (`tokenize_pairs`); `PairCollator` stacks a batch of B pairs into 2B right-padded rows,
chosen first; `sequence_logps` gives each row's summed completion log-prob, from the final
hidden states through `stages.kernels.chunked_logprobs` where the model allows (see
`stages.logprobs`), else from the logits through `stages.kernels.selective_log_softmax`.
`stages.losses.preference_loss` combines the named objectives on those sums.

The small trainer plumbing the preference trainers share (a tokenised `datasets.Dataset`,
metric averaging) sits at the end; their evaluation's predictions: `stages.trainers.eval_predictions`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.batch_prefix import prefix_hidden
from stages.data.templates import maybe_extract_prompt
from stages.data.tokenize import tokenize_sft
from stages.kernels import selective_log_softmax
from stages.logprobs import causal_lm, head_logprobs
from stages.losses.pair_length import ld_logps, log_sum_sq_probs
from stages.pair_packing import forward_inputs
from stages.tensors import pad

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # precomputed reference log-probs (summed) per pair


def tokenize_pairs(tokenizer, rows: list[dict], max_length: int, keep: tuple[str, ...] = (), *, start: int = 0
                   ) -> list[dict]:
    """Each prompt/chosen/rejected row -> chosen_* and rejected_* input_ids and completion_mask.

    The columns REF_COLUMNS, "weight" and `keep` are carried over when present. Rows without a
    "prompt" (TRL's implicit-prompt shape: whole conversations as chosen and rejected) get the part
    both sides share as their prompt (`stages.data.templates.maybe_extract_prompt`; none shared: empty).
    `start`: the index of the first of `rows` in the whole dataset (rows are tokenised in batches).
    """
    rows = [r if "prompt" in r else _with_prompt(maybe_extract_prompt(r)) for r in rows]
    identical = [start + i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]
    if identical:
        raise ValueError(f"{len(identical)} preference row(s) have identical chosen and rejected (first: row "
                         f"{identical[0]}); they carry no preference: drop them in preprocess")
    carry = set(REF_COLUMNS) | {"weight"} | set(keep)
    out = []
    for side in ("chosen", "rejected"):
        toks = tokenize_sft(tokenizer, [{"prompt": r["prompt"], "completion": r[side], "tools": r.get("tools")}
                                        for r in rows],
                            max_length=max_length)
        for i, t in enumerate(toks):
            if not any(t["completion_mask"]):
                raise ValueError(f"row {start + i}: the prompt fills max_length = {max_length}; nothing of the {side} "
                                 "completion is left (raise max_length or filter long prompts)")
            if side == "chosen":
                out.append({k: v for k, v in rows[i].items() if k in carry})
            out[i].update({f"{side}_input_ids": t["input_ids"], f"{side}_completion_mask": t["completion_mask"]})
    return out


def _with_prompt(row: dict) -> dict:
    if "prompt" in row:
        return row
    return {**row, "prompt": "" if isinstance(row["chosen"], str) else []}


@dataclass
class PairCollator:
    """Features -> one batch of 2B rows: chosen first, then rejected; right-padded (to a multiple of
    `pad_to_multiple_of` when set)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.tensor(f[f"{s}_input_ids"]) for s in ("chosen", "rejected") for f in features]
        masks = [torch.tensor(f[f"{s}_completion_mask"]) for s in ("chosen", "rejected") for f in features]
        multiple = self.pad_to_multiple_of
        batch = {"input_ids": pad(ids, padding_value=self.pad_token_id, pad_to_multiple_of=multiple),
                 "attention_mask": pad([torch.ones_like(i) for i in ids], pad_to_multiple_of=multiple),
                 "completion_mask": pad(masks, pad_to_multiple_of=multiple)}
        for col in (*REF_COLUMNS, "weight"):
            if col in features[0]:
                batch[col] = torch.tensor([f[col] for f in features], dtype=torch.float32)
        return batch


def sequence_logps(model, batch: dict[str, torch.Tensor], *, average: bool = False, chunked: bool = True,
                   pairs: bool = False, ld_alpha: float | None = None, padding_free: bool = False) -> torch.Tensor:
    """Summed (or per-token averaged) completion log-probs of every row: (rows,).

    pairs: the rows are a `PairCollator` batch (B chosen, then B rejected); each pair then runs as one row
    packed on its shared prefix where the model allows (`stages.pair_packing`), with the same result.
    ld_alpha: LD-DPO's sum (`stages.losses.pair_length.ld_logps`; needs a `PairCollator` batch).
    padding_free: the pairs packed and the batch joined into one row without padding (`stages.pair_packing`).
    """
    per_token, _ = token_logps(model, batch, chunked=chunked, pairs=pairs, padding_free=padding_free)
    if ld_alpha is not None:
        total = ld_logps(per_token, batch["completion_mask"][:, 1:], ld_alpha)
    else:
        total = per_token.sum(-1)
    return total / completion_token_counts(batch).clamp(min=1) if average else total


def token_logps(model, batch: dict[str, torch.Tensor], *, chunked: bool = True, pairs: bool = False,
                sum_sq: bool = False, padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token completion log-probs of every row, (rows, T-1), 0 outside the completion; and with `sum_sq`
    the detached log Σ_v p(v)² at the same positions (WPO's alignment, `stages.losses.pair_length`), else None.
    `sum_sq` needs the whole distribution, so it takes the logits path even where chunking is possible.
    `model`: a module, or the `stages.logprobs.CausalLM` the trainer built of it; read once here, the view goes
    down to the packing, the forward and the head."""
    lm = causal_lm(model)
    inputs, unpack = forward_inputs(lm, batch["input_ids"], batch["attention_mask"], pairs=pairs,
                                    padding_free=padding_free)
    targets = batch["input_ids"][:, 1:]
    select = batch["completion_mask"][:, 1:].bool()
    head = lm.head if chunked and not sum_sq else None
    per_token = torch.zeros(select.shape, dtype=torch.float32, device=targets.device)
    squares = None
    if head is not None:
        hidden = prefix_hidden(lm, inputs, first_read(select))
        if hidden is None:
            hidden, _ = lm.hidden({**inputs, "use_cache": False}, logits_to_keep=lm.no_logits)
        hidden = unpack(hidden)[:, :-1][select]
        per_token = per_token.masked_scatter(select, head_logprobs(hidden, head, targets[select]).float())
    else:
        logits = unpack(lm.model(**inputs, use_cache=False).logits)[:, :-1]
        per_token = torch.where(select, selective_log_softmax(logits, targets).float(), per_token)
        if sum_sq:
            with torch.no_grad():
                squares = torch.where(select, log_sum_sq_probs(logits), torch.zeros_like(per_token))
    return per_token, squares


def first_read(select: torch.Tensor) -> int:
    """The first position whose hidden state is read in the padded rows (`select`, B x T-1; their width where none
    is): no later than the first column read in the forward's rows, packed or not (a packed pair keeps its chosen
    row's positions and moves the rejected row's suffix right)."""
    rows = select.any(1)
    return int(select.int().argmax(1)[rows].min()) if bool(rows.any()) else select.shape[1]


def completion_token_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Completion tokens scored per row (the first token is never predicted): (rows,)."""
    return batch["completion_mask"][:, 1:].sum(-1)


def tokenized_dataset(rows, marker: str, tokenize: Callable[..., list[dict]], *, tokenizer,
                      num_proc: int | None = None):
    """`rows` (an iterable of dicts, a Dataset or an IterableDataset, or None) as a tokenised `datasets.Dataset`:
    `tokenize(rows, start=i)` over batches through `Dataset.map(num_proc=num_proc)`, cached as Arrow files keyed
    by the rows', the tokenizer's and the code's content (stages.data.tokenize.tokenized_dataset). Rows whose
    first row already has the column `marker` (tokenised beforehand) are taken as they are; None stays None."""
    from stages.data import tokenize as tokenizing

    return tokenizing.tokenized_dataset(rows, tokenize, marker=marker, tokenizer=tokenizer, num_proc=num_proc)


def flush_metrics(metrics: dict[str, list[float]], logs: dict[str, float], prefix: str = "") -> None:
    """Average each accumulated metric into `logs` (keys prefixed) and clear them."""
    for key, values in metrics.items():
        logs[f"{prefix}{key}"] = sum(values) / len(values)
    metrics.clear()

