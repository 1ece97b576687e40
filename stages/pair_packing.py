"""Preference pairs packed on their shared prefix: one row per pair instead of two.

A pair's chosen and rejected rows start with the same tokens: the prompt at least, and often much
more (a reasoning block that only differs in its last step, a sampled completion that agrees with
the other one for a while). The padded layout (`preference.PairCollator`: 2B rows, chosen first)
runs that shared prefix through the model twice. Packed, each pair becomes one row

    [ shared prefix | chosen suffix | rejected suffix ]

with position ids that restart the rejected suffix where the prefix ends, and an attention mask
under which the rejected suffix sees the prefix and itself but not the chosen suffix. Every token
then has exactly the context it has in its own padded row, so the hidden states are the same (up to
float rounding in the attention's reductions), and `PackedPairs.unpack` gathers them back into the
2B-row layout: everything after the forward (the chunked log-probs, the reward head's last-token
read-out) runs unchanged. Gradients reach the shared prefix from both sides, as they would through
two copies.

When it is used (`pack_pairs` returns None otherwise, and the caller runs the padded rows):
- the model's attention takes a 4D mask: `sdpa` (a bool mask) or `eager` (an additive one); flash
  and flex attention kernels do not;
- the model is not sharded (FSDP / ZeRO-3), and is not a sliding-window model whose window is shorter
  than the batch (a 4D mask replaces the window);
- packing saves at least a tenth of the tokens (packed width x B against padded width x 2B);
- the first packed forward of each model is checked against the padded one on two pairs (eval mode,
  no gradients): a model that ignores position ids or custom masks (remote code, an unusual
  architecture) is found there, logged once by name, and keeps the padded path.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from stages.logprobs import CausalLM, hidden_through
from stages.precision import CPU_FP32_SDPA

log = logging.getLogger(__name__)

MASKED_ATTENTION = ("sdpa", CPU_FP32_SDPA, "eager")  # attention implementations that take a custom 4D mask
MIN_SAVING = 0.1                      # pack only when it removes at least this share of the tokens
CHECK_PAIRS = 2                       # pairs compared packed against padded on a model's first packed forward
TOLERANCE = 0.05                      # largest relative difference of a hidden state accepted there
_checked: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass
class PackedPairs:
    """B pairs as B packed rows, and the map back to the 2B padded rows (chosen first)."""

    input_ids: torch.Tensor      # (B, P)
    position_ids: torch.Tensor   # (B, P)
    mask: torch.Tensor           # (B, 1, P, P) bool: query attends key
    rows: torch.Tensor           # (2B,) packed row of each padded row
    index: torch.Tensor          # (2B, T) packed position of each padded position (0 at padding)

    def inputs(self, lm: CausalLM) -> dict[str, torch.Tensor]:
        """The forward's input_ids, position_ids and 4D attention_mask, in the form `lm`'s attention takes."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "attention_mask": attention_mask_for(lm, self.mask)}

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(B, P, ...) per packed position -> (2B, T, ...) per padded position (padding: position 0's value)."""
        return packed[self.rows[:, None], self.index]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def joined(self) -> PackedPairs:
        """The B packed rows joined into one row without padding, (1, N) for the N tokens of all pairs; the 4D mask
        is block-diagonal, so no pair sees another, and positions still restart at every pair."""
        b, width = self.input_ids.shape
        lengths = self.index.view(2, b, -1).amax(dim=(0, 2)) + 1                  # (B,) packed length of each pair
        j = torch.arange(width, device=self.input_ids.device)
        valid = j < lengths[:, None]                                              # (B, P)
        pair = torch.arange(b, device=j.device).repeat_interleave(lengths)        # (N,) the pair of each token
        local = j.expand(b, -1)[valid]                                            # (N,) its position in the pair
        mask = self.mask[pair[:, None], 0, local[:, None], local[None, :]] & (pair[:, None] == pair[None, :])
        offsets = lengths.cumsum(0) - lengths
        return PackedPairs(self.input_ids[valid][None], self.position_ids[valid][None], mask[None, None],
                           torch.zeros_like(self.rows), offsets[self.rows][:, None] + self.index)


def attention_mask_for(lm: CausalLM, mask: torch.Tensor) -> torch.Tensor:
    """A bool 4D mask (query attends key) in the form `lm`'s attention takes: as it is for sdpa, additive for eager
    (0 where attended, the dtype's minimum elsewhere)."""
    if lm.attention != "eager":
        return mask
    dtype = lm.dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int = 0) -> PackedPairs | None:
    """Pack the 2B right-padded rows of `PairCollator` (chosen rows first): None when they are not right-padded."""
    rows2, width = input_ids.shape
    if rows2 % 2 or rows2 == 0:
        return None
    lengths = attention_mask.sum(-1)
    positions = torch.arange(width, device=input_ids.device)
    if not bool((attention_mask.bool() == (positions < lengths[:, None])).all()):
        return None  # left padding or holes: not this layout
    b = rows2 // 2
    chosen, rejected = input_ids[:b], input_ids[b:]
    n_chosen, n_rejected = lengths[:b], lengths[b:]
    both = (positions < n_chosen[:, None]) & (positions < n_rejected[:, None])
    prefix = ((chosen == rejected) & both).long().cumprod(-1).sum(-1)          # (B,) shared prefix length
    packed_len = n_chosen + n_rejected - prefix
    width_p = int(packed_len.max())
    # packed position of every padded position: chosen t -> t; rejected t -> t before the prefix ends, else after
    # the chosen suffix; padding -> a dump column (width_p) dropped below, then 0 in the returned index
    index_c = torch.where(positions < n_chosen[:, None], positions, width_p)
    index_r = torch.where(positions < prefix[:, None], positions, positions + (n_chosen - prefix)[:, None])
    index_r = torch.where(positions < n_rejected[:, None], index_r, width_p)
    ids = torch.full((b, width_p + 1), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids.scatter_(1, index_c, chosen).scatter_(1, index_r, rejected)
    pos = torch.zeros((b, width_p + 1), dtype=torch.long, device=input_ids.device)
    pos.scatter_(1, index_c, positions.expand(b, -1).contiguous()).scatter_(1, index_r,
                                                                           positions.expand(b, -1).contiguous())
    j = torch.arange(width_p, device=input_ids.device)
    valid = j < packed_len[:, None]                                           # (B, P)
    in_rejected = valid & (j >= n_chosen[:, None])
    in_chosen_suffix = (j >= prefix[:, None]) & (j < n_chosen[:, None])
    mask = (j[None, :, None] >= j[None, None, :]) & valid[:, :, None] & valid[:, None, :]
    mask &= ~(in_rejected[:, :, None] & in_chosen_suffix[:, None, :])       # rejected never sees the chosen suffix
    mask |= torch.eye(width_p, dtype=torch.bool, device=input_ids.device) & ~valid[:, :, None]  # padding sees itself
    index = torch.cat([index_c, index_r]).masked_fill(torch.cat([index_c, index_r]) == width_p, 0)
    rows = torch.arange(b, device=input_ids.device).repeat(2)
    return PackedPairs(ids[:, :width_p], pos[:, :width_p], mask[:, None], rows, index)


def forward_inputs(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pairs: bool,
                   padding_free: bool = False):
    """(the forward's inputs, a function taking its per-position outputs back to the padded rows): packed where
    `pairs` and `pack_pairs` allow, else the padded rows themselves and the identity. `padding_free` (TRL's
    DPOConfig.padding_free): always packed, and the batch joined into one row without padding
    (`PackedPairs.joined`); a ValueError saying why when the model cannot run that."""
    if padding_free:
        joined = padding_free_pairs(lm, input_ids, attention_mask)
        return joined.inputs(lm), joined.unpack
    packed = pack_pairs(lm, {"input_ids": input_ids, "attention_mask": attention_mask}) if pairs else None
    if packed is None:
        return {"input_ids": input_ids, "attention_mask": attention_mask}, (lambda x: x)
    return packed.inputs(lm), packed.unpack


def pack_pairs(lm: CausalLM, batch: dict[str, torch.Tensor]) -> PackedPairs | None:
    """`batch` (2B padded pair rows) packed for `lm`, or None when the padded rows should be used."""
    if not packable(lm):
        return None
    packed = layout(batch["input_ids"], batch["attention_mask"])
    if not worth_it(lm, packed, batch["input_ids"]):
        return None
    return packed if verified(lm, batch) else None


def padding_free_pairs(lm: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedPairs:
    """The 2B padded pair rows as one packed row without padding; a ValueError when `lm` cannot run it."""
    why = None
    if not packable(lm):
        why = (f"its attention is {lm.attention!r}{' and sharded' if lm.sharded else ''}"
               f"; the pairs share their prefix through a 4D mask, which needs an unsharded model with one of "
               f"{', '.join(MASKED_ATTENTION)} (attn_implementation)")
    packed = layout(input_ids, attention_mask) if why is None else None
    if why is None and packed is None:
        why = "the batch is not PairCollator's right-padded chosen-then-rejected rows"
    window = lm.sliding_window
    if packed is not None and window is not None and packed.position_ids.max() >= window:
        why = f"a pair is longer than the model's sliding window ({window} tokens), which a 4D mask replaces"
    if why is None and not verified(lm, {"input_ids": input_ids, "attention_mask": attention_mask}):
        why = "its packed forward differs from the padded one (it ignores position_ids or 4D attention masks)"
    if why is not None:
        raise ValueError(f"padding_free = True: {type(lm.inner).__name__} cannot run a batch as one "
                         f"row without padding: {why}; set padding_free: false (pairs then run padded, or packed "
                         "where it saves tokens)")
    assert packed is not None
    return packed.joined()


def packable(lm: CausalLM) -> bool:
    """Whether `lm` can run packed rows at all: a 4D-mask attention and unsharded parameters."""
    return lm.attention in MASKED_ATTENTION and not lm.sharded


def worth_it(lm: CausalLM, packed: PackedPairs | None, padded_ids: torch.Tensor) -> bool:
    """Whether `packed` saves at least MIN_SAVING of the padded tokens and fits the model's sliding window."""
    if packed is None or packed.tokens > (1 - MIN_SAVING) * padded_ids.numel():
        return False
    window = lm.sliding_window
    return window is None or bool(packed.position_ids.max() < window)


def verified(lm: CausalLM, batch: dict[str, torch.Tensor]) -> bool:
    """Whether `lm` computes the same final hidden states packed as padded (checked once per model, on the
    first CHECK_PAIRS pairs of `batch`)."""
    if lm.inner in _checked:
        return _checked[lm.inner]
    b = batch["input_ids"].shape[0] // 2
    n = min(CHECK_PAIRS, b)
    keep = torch.cat([torch.arange(n), b + torch.arange(n)]).to(batch["input_ids"].device)
    ids, attn = batch["input_ids"][keep], batch["attention_mask"][keep]
    width = int(attn.sum(-1).max())
    ids, attn = ids[:, :width], attn[:, :width]
    packed = layout(ids, attn)
    assert packed is not None  # a slice of a layout that packed
    return same_as_padded(lm, {"input_ids": ids, "attention_mask": attn}, packed)


def same_as_padded(lm: CausalLM, padded: dict[str, torch.Tensor], packed: PackedPairs) -> bool:
    """Whether `lm`'s final hidden states of the `padded` rows equal those of `packed`, unpacked, at every
    attended position (eval mode, no gradients); remembered per model, and logged by name when not."""
    inner = lm.inner
    if inner in _checked:
        return _checked[inner]
    if lm.norm is None:
        _checked[inner] = False
        return False
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            expected, _ = hidden_through(inner, lm.norm, {**padded, "use_cache": False})
            hidden, _ = hidden_through(inner, lm.norm, {**packed.inputs(lm), "use_cache": False})
    finally:
        inner.train(was_training)
    valid = padded["attention_mask"].bool()
    diff = hidden_difference(expected[valid], packed.unpack(hidden)[valid])
    ok = diff <= TOLERANCE
    if not ok:
        log.warning("packing is off for %s: its packed forward differs from the padded one by %.3g of a hidden "
                    "state's norm (it ignores position_ids or 4D attention masks); rows that share a prefix run "
                    "as separate rows", type(inner).__name__, diff)
    _checked[inner] = ok
    return ok


def hidden_difference(expected: torch.Tensor, got: torch.Tensor) -> float:
    """The largest error of the hidden states `got` against `expected` (positions, H), each relative to the expected
    state's norm: float rounding stays far below TOLERANCE; a token given the wrong context (an ignored mask, cache
    or position id) is off by the order of the norm itself."""
    expected, got = expected.float(), got.float()
    return float(((expected - got).norm(dim=-1) / expected.norm(dim=-1).clamp(min=1e-6)).max())
