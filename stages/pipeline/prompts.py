"""Where the stages after SFT find their rows: preference pairs, unpaired rows and prompts.

`preprocess` writes what the data source provides (preference.jsonl, unpaired.jsonl,
prompts.jsonl, sft_train.jsonl); `score` writes pairs sampled from the SFT model and scored.
These functions pick the right file for a stage and fall back to deriving what is missing
(prompts from pairs or SFT rows, unpaired rows from pairs), so user data in any of the
supported formats reaches every method.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.data import DataError, read_jsonl
from stages.data.templates import unpair_preference_dataset
from stages.trainers import online_generation

PAIR_SOURCES = ("score", "preprocess")


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.exists() else []


def preference_pairs(ctx, source: str, *, key: str = "policy.data") -> tuple[Path, list[dict[str, Any]]]:
    """(file, prompt/chosen/rejected rows) from `score`'s pairs or `preprocess`'s preference data."""
    if source not in PAIR_SOURCES:
        raise ValueError(f"{key} = {source!r}: one of {', '.join(PAIR_SOURCES)}")
    path = ctx.inputs["score"] / "pairs.jsonl" if source == "score" else ctx.inputs["preprocess"] / "preference.jsonl"
    rows = _rows(path)
    if not rows:
        why = ("score produced no pairs (score.enabled false, or every prompt filtered: see the score manifest)"
               if source == "score" else "the data (data.preference or data.source) has no prompt/chosen/rejected "
               "rows")
        raise DataError(f"{path}: no preference pairs; {key} = {source}: {why}. Use {key} = "
                        f"{'preprocess' if source == 'score' else 'score'}, or a source with pairs")
    return path, rows


def unpaired_rows(ctx, source: str) -> list[dict[str, Any]]:
    """prompt/completion/label rows for KTO: preprocess's unpaired.jsonl, else the pairs split in two."""
    if source == "preprocess":
        rows = _rows(ctx.inputs["preprocess"] / "unpaired.jsonl")
        if rows:
            return rows
    _, pairs = preference_pairs(ctx, source)
    return list(unpair_preference_dataset([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in pairs]))


def prompt_rows(ctx, limit: int = -1) -> list[dict[str, Any]]:
    """Prompts to sample from, each with its extra columns (e.g. `answer`, a reference `completion`).

    preprocess's prompts.jsonl when the source has one; else the distinct prompts of the
    preference pairs (chosen as the reference completion) or of the SFT rows.
    """
    pre = ctx.inputs["preprocess"]
    rows = _rows(pre / "prompts.jsonl")
    if not rows:
        derived = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in _rows(pre / "preference.jsonl")]
        derived += [{"prompt": r["prompt"], "completion": r["completion"]} for r in _rows(pre / "sft_train.jsonl")
                    if "prompt" in r and "completion" in r]
        seen, rows = set(), []
        for r in derived:
            key = json.dumps(r["prompt"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                rows.append(r)
    if not rows:
        raise DataError(f"{pre}: no prompts to sample from: give prompt-only rows (data.prompts), preference "
                        "rows (data.preference) or prompt/completion SFT rows (data.sft)")
    return rows[:limit] if limit > 0 else rows


def reward_model_path(ctx) -> str | None:
    """The reward stage's model folder, or None when it trained none (no preference data)."""
    folder = ctx.inputs["reward"] / "model"
    return str(folder) if folder.is_dir() else None


backend_options = online_generation.backend_options  # one definition, shared with the online trainers
