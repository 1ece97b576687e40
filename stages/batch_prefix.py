"""The tokens that every row of a forward starts with, computed once.

The rows of a batch often start alike: a chat template's default system prompt, a fixed instruction, a few-shot
header. A forward over B rows computes those first L tokens B times, with the same result in every row (the same
tokens at the same positions, each seeing only the ones before it). Here they run once, as one row with the
key/value cache on; the B rows then run from column L on that cache (repeated over them) under their own attention
mask from row L on. Every later token has the context it has in the whole forward, so the final hidden states from
column L on are the same up to float rounding, and gradients reach the shared tokens from every row through the
cache, summed, as they would be over B copies.

`prefix_hidden(lm, inputs, first_read)` runs a forward that way and returns its final hidden states (B, T, H), the
first L columns zero (no row reads them: `first_read`); None where it does not apply, and the caller runs the
forward whole:
- the inputs carry position ids and a 4D attention mask (the packed layouts of `stages.pair_packing`), and the model
  takes them with a cache: `pair_packing.packable` (sdpa or eager attention, unsharded), and no activation
  checkpointing in training (which turns the cache off);
- at least MIN_TOKENS shared over at least 2 rows, each of them seeing exactly the ones before it in every row;
- the first such forward of each model is checked against the whole forward on CHECK_ROWS rows (eval mode, no
  gradients): a model that ignores the cache, the mask or position ids keeps the whole forward, logged once by name.
"""
from __future__ import annotations

import logging
import weakref

import torch

from stages.logprobs import CausalLM, hidden_through
from stages.pair_packing import TOLERANCE, hidden_difference, packable
from stages.prompt_cache import returned_cache

log = logging.getLogger(__name__)

MIN_TOKENS = 16  # shared first tokens worth a forward of their own
CHECK_ROWS = 2   # rows compared with the whole forward on a model's first shared-prefix forward
_checked: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def prefix_hidden(lm: CausalLM, inputs: dict[str, torch.Tensor], first_read: int) -> torch.Tensor | None:
    """The final hidden states (B, T, H) of `lm`'s forward on `inputs` (input_ids, position_ids and a 4D
    attention_mask in the form `lm` takes), its shared first tokens run once; zero in the columns of those tokens,
    which are all before `first_read` (the first column any row reads). None where it does not apply."""
    length = shared_length(lm, inputs, first_read)
    if length < MIN_TOKENS or not verified(lm, inputs, length):
        return None
    return _forward(lm, lm.model, inputs, length)


def shared_length(lm: CausalLM, inputs: dict[str, torch.Tensor], first_read: int) -> int:
    """How many first columns every row of `inputs` holds the same tokens at, at positions 0, 1, ..., each seeing the
    ones before it and itself only, before `first_read`; 0 where the model or the inputs do not allow a shared run."""
    ids, positions, mask = inputs["input_ids"], inputs.get("position_ids"), inputs.get("attention_mask")
    rows, width = ids.shape
    if rows < 2 or positions is None or mask is None or mask.dim() != 4 or not usable(lm):
        return 0
    columns = torch.arange(width, device=ids.device)
    same = (ids == ids[:1]).all(0) & (positions == columns).all(0)
    length = min(int(same.long().cumprod(0).sum()), first_read)
    if length == 0:
        return 0
    seen = mask[:, 0, :length, :length]
    seen = seen if seen.dtype == torch.bool else seen == 0  # eager's additive mask: 0 where attended
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return length if bool((seen == causal).all()) else 0


def usable(lm: CausalLM) -> bool:
    """Whether `lm` can run rows on a cache under a 4D mask, gradients included."""
    checkpointing = lm.inner.training and bool(getattr(lm.inner, "is_activation_checkpointing", False))
    return packable(lm) and not checkpointing and _checked.get(lm.inner) is not False


def _forward(lm: CausalLM, module: torch.nn.Module, inputs: dict[str, torch.Tensor], length: int
             ) -> torch.Tensor | None:
    """`prefix_hidden` through `module` (the model as called: wrappers kept, or the bare model for the check)."""
    ids, positions, mask = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    _, out = hidden_through(module, lm.norm, {"input_ids": ids[:1, :length], "position_ids": positions[:1, :length],
                                              "attention_mask": mask[:1, :, :length, :length], "use_cache": True},
                            logits_to_keep=lm.no_logits)
    cache = returned_cache(out)
    if cache is None:
        return None
    cache.batch_repeat_interleave(ids.shape[0])
    rest, _ = hidden_through(module, lm.norm, {"input_ids": ids[:, length:], "position_ids": positions[:, length:],
                                               "attention_mask": mask[:, :, length:], "cache": cache,
                                               "use_cache": True}, logits_to_keep=lm.no_logits)
    return torch.cat([rest.new_zeros(ids.shape[0], length, rest.shape[-1]), rest], 1)


def verified(lm: CausalLM, inputs: dict[str, torch.Tensor], length: int) -> bool:
    """Whether `lm` gives the whole forward's final hidden states from column `length` on when its first `length`
    columns run once (checked once per model on the first CHECK_ROWS rows, eval mode, no gradients); remembered per
    model, and logged by name when not."""
    inner = lm.inner
    if inner in _checked:
        return _checked[inner]
    part = {key: value[:CHECK_ROWS] for key, value in inputs.items()}
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            expected, _ = hidden_through(inner, lm.norm, {**part, "use_cache": False}, logits_to_keep=lm.no_logits)
            got = _forward(lm, inner, part, length)
    except (TypeError, ValueError, RuntimeError) as e:  # a forward that takes no cache, 4D mask or position ids
        log.warning("shared prefixes are off for %s: %s", type(inner).__name__, e)
        got = None
    finally:
        inner.train(was_training)
    ok = got is not None and hidden_difference(expected[:, length:].flatten(0, 1), got[:, length:].flatten(0, 1)) \
        <= TOLERANCE
    if not ok and got is not None:
        log.warning("shared prefixes are off for %s: its forward on a cached prefix differs from the whole forward "
                    "(it ignores the cache, position_ids or 4D attention masks); rows run whole",
                    type(inner).__name__)
    _checked[inner] = ok
    return ok
