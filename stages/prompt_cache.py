"""Rows that continue the prompts of rows just run, from those prompts' cached keys and values.

KTO's KL estimate scores each prompt with another row's completion (a mismatched row) under the policy, without
gradients. Run as its own padded rows, that forward goes through every prompt a second time; packed with the
matched rows (`stages.pair_packing`), it goes through the backward as well, since the packed row carries
gradients. Here the matched rows' forward (with gradients) keeps its keys and values (`cache`), and a second
forward without gradients runs the mismatched completions alone: a 4D attention mask lets each of their tokens
see its own prompt's cached keys and the completion's earlier tokens, never the matched completion, and position
ids continue where the prompt ends. Every token then has the context it has in its own padded row. The first
mismatched token is predicted from the prompt's last hidden state, which the matched forward computed already.

When it is used (`continued_logps` returns None otherwise, and the caller packs or pads):
- the chunked log-probs' head, a 4D-mask attention on an unsharded model (`stages.pair_packing.packable`), and
  rows shorter than the model's sliding window, if it has one;
- both parts are right-padded rows that start with the same prompt (KTOCollator's layout), at least one token;
- the first time per model, the result is compared with the mismatched rows' own padded forward (eval mode, no
  gradients): a model whose cached continuation differs (remote code, a forward that ignores position ids or 4D
  masks) keeps the other path, logged once by name. A forward that returns no cache (activation checkpointing
  turns it off) falls back for that batch to a padded forward without gradients.
"""
from __future__ import annotations

import logging
import weakref

import torch

from stages.logprobs import CausalLM, causal_lm, head_logprobs, hidden_through
from stages.pair_packing import TOLERANCE, attention_mask_for, hidden_difference, packable

log = logging.getLogger(__name__)

CHECK_ROWS = 2         # rows compared against their padded forward on a model's first use
_checked: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def continued_logps(model, matched: dict[str, torch.Tensor], continued: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(summed completion log-probs of the `matched` rows, with gradients; those of the `continued` rows, which
    share each matched row's prompt, without), from one forward with gradients over the matched rows and one
    without over the continued completions; None where this module does not apply (see its docstring).
    Both dicts hold input_ids, attention_mask and completion_mask (B, T), right-padded."""
    lm = causal_lm(model)
    if lm.head is None or not packable(lm) or _checked.get(lm.inner) is False:
        return None
    window = lm.sliding_window  # a 4D mask replaces the window: only rows shorter than it
    if window is not None and max(matched["input_ids"].shape[1], continued["input_ids"].shape[1]) >= window:
        return None
    starts = shared_prompt_lengths(matched, continued)
    if starts is None or not verified(lm, matched, continued, starts):
        return None
    hidden, out = lm.hidden({"input_ids": matched["input_ids"], "attention_mask": matched["attention_mask"],
                             "use_cache": True}, logits_to_keep=lm.no_logits)
    logps = row_logps(hidden, lm, matched)
    with torch.no_grad():
        cache = returned_cache(out)
        if cache is None:  # no cache came back (activation checkpointing): the continued rows padded
            kl_hidden, _ = lm.hidden({"input_ids": continued["input_ids"],
                                      "attention_mask": continued["attention_mask"], "use_cache": False},
                                     logits_to_keep=lm.no_logits)
            return logps, row_logps(kl_hidden, lm, continued)
        return logps, continuation(lm, lm.model, cache, hidden.detach(), continued, starts)


def returned_cache(out):
    """The key/value cache a forward returned (transformers 5 names it `cache`, earlier ones past_key_values)."""
    for key in ("cache", "past_key_values"):
        if out.get(key) is not None:
            return out[key]
    return None


def shared_prompt_lengths(matched: dict[str, torch.Tensor], continued: dict[str, torch.Tensor]
                          ) -> torch.Tensor | None:
    """(B,) prompt length of each row (its first completion token), or None when the two parts are not
    right-padded rows with the same non-empty prompt."""
    ids_m, ids_c = matched["input_ids"], continued["input_ids"]
    if ids_m.shape[0] != ids_c.shape[0] or ids_m.shape[0] == 0:
        return None
    starts = matched["completion_mask"].int().argmax(-1)
    if not bool((starts == continued["completion_mask"].int().argmax(-1)).all()) or bool((starts < 1).any()):
        return None
    for part in (matched, continued):
        mask = part["attention_mask"].bool()
        j = torch.arange(mask.shape[1], device=mask.device)
        if not bool((mask == (j < mask.sum(-1, keepdim=True))).all()):
            return None  # not right-padded
    width = int(starts.max())
    j = torch.arange(width, device=starts.device)
    in_prompt = j < starts[:, None]
    same = (ids_m[:, :width] == ids_c[:, :width]) | ~in_prompt
    return starts if bool(same.all()) else None


def row_logps(hidden: torch.Tensor, lm: CausalLM, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log-probs of each row's completion tokens from the final hidden states of its padded forward."""
    targets, select = rows["input_ids"][:, 1:], rows["completion_mask"][:, 1:].bool()
    per_token = torch.zeros(select.shape, dtype=torch.float32, device=targets.device)
    assert lm.head is not None
    values = head_logprobs(hidden[:, :-1][select], lm.head, targets[select]).float()
    return per_token.masked_scatter(select, values).sum(-1)


def continuation(lm: CausalLM, module: torch.nn.Module, cache, prompt_hidden: torch.Tensor,
                 continued: dict[str, torch.Tensor], starts: torch.Tensor) -> torch.Tensor:
    """Summed log-probs of the continued rows' completions (B,), from the matched forward's `cache` (keys of width
    T) and final hidden states `prompt_hidden` (B, T, H), running only the completions through `module`."""
    hidden, tokens, valid = continuation_hidden(lm, module, cache, prompt_hidden, continued, starts)
    assert lm.head is not None
    per_token = torch.zeros(valid.shape, dtype=torch.float32, device=tokens.device)
    values = head_logprobs(hidden[valid], lm.head, tokens[valid]).float()
    return per_token.masked_scatter(valid, values).sum(-1)


def continuation_hidden(lm: CausalLM, module: torch.nn.Module, cache, prompt_hidden: torch.Tensor,
                        continued: dict[str, torch.Tensor], starts: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the final hidden state that predicts each completion token (B, C, H), the tokens (B, C), which are real
    (B, C)) of the continued rows: the prompt's last from `prompt_hidden`, the rest from one forward of the
    completions through `module` on the matched forward's `cache`."""
    ids = continued["input_ids"]
    b, device = ids.shape[0], ids.device
    lengths = continued["attention_mask"].sum(-1) - starts                     # (B,) completion tokens per row
    width = int(lengths.max())
    k = torch.arange(width, device=device)
    valid = k < lengths[:, None]                                               # (B, C)
    tokens = ids.gather(1, (starts[:, None] + k).clamp(max=ids.shape[1] - 1))  # (B, C) the completions
    hidden = prompt_hidden[torch.arange(b, device=device), starts - 1][:, None]  # (B, 1, H) predicts token 0
    if width > 1:
        queries, cached = width - 1, cache.get_seq_length()
        q = torch.arange(queries, device=device)
        sees_cache = (torch.arange(cached, device=device) < starts[:, None])[:, None, :].expand(b, queries, cached)
        sees_own = (q[None, :] <= q[:, None]) & (valid[:, None, :queries] | (q[None, :] == q[:, None]))
        mask = torch.cat([sees_cache, sees_own], -1)[:, None]                   # (B, 1, Q, T + Q)
        inputs = {"input_ids": tokens[:, :queries], "position_ids": starts[:, None] + q,
                  "attention_mask": attention_mask_for(lm, mask), "cache": cache, "use_cache": True}
        rest, _ = hidden_through(module, lm.norm, inputs, logits_to_keep=lm.no_logits)
        hidden = torch.cat([hidden, rest], 1)
    return hidden, tokens, valid


def verified(lm: CausalLM, matched: dict[str, torch.Tensor], continued: dict[str, torch.Tensor],
             starts: torch.Tensor) -> bool:
    """Whether `lm`'s cached continuation gives the final hidden states of the continued rows' padded forward
    (checked once per model, on the first CHECK_ROWS rows, eval mode, no gradients); remembered per model, and
    logged by name when not."""
    inner = lm.inner
    if inner in _checked:
        return _checked[inner]
    n = min(CHECK_ROWS, matched["input_ids"].shape[0])
    part_m = {k: v[:n] for k, v in matched.items()}
    part_c = {k: v[:n] for k, v in continued.items()}
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            expected, _ = hidden_through(inner, lm.norm, {"input_ids": part_c["input_ids"],
                                                          "attention_mask": part_c["attention_mask"],
                                                          "use_cache": False}, logits_to_keep=lm.no_logits)
            hidden, out = hidden_through(inner, lm.norm, {"input_ids": part_m["input_ids"],
                                                          "attention_mask": part_m["attention_mask"],
                                                          "use_cache": True}, logits_to_keep=lm.no_logits)
            cache = returned_cache(out)
            if cache is not None:
                got, _, valid = continuation_hidden(lm, inner, cache, hidden, part_c, starts[:n])
    except (TypeError, ValueError, RuntimeError) as e:  # a forward that takes no cache, 4D mask or position ids
        log.warning("cached continuations are off for %s: %s", type(inner).__name__, e)
        _checked[inner] = False
        return False
    finally:
        inner.train(was_training)
    if cache is None:
        return True  # no cache at all: continued_logps falls back per batch; nothing to compare
    # the padded rows' hidden state at each position that predicts a completion token, against the continuation's
    k = torch.arange(valid.shape[1], device=valid.device)
    rows = torch.arange(n, device=valid.device)[:, None].expand_as(valid)
    diff = hidden_difference(expected[rows[valid], (starts[:n, None] - 1 + k)[valid]], got[valid])
    ok = diff <= TOLERANCE
    if not ok:
        log.warning("cached continuations are off for %s: they differ from the padded forward by %.3g of a "
                    "hidden state's norm (it ignores position ids or 4D attention masks with a cache); KTO's "
                    "mismatched rows run packed or padded", type(inner).__name__, diff)
    _checked[inner] = ok
    return ok
