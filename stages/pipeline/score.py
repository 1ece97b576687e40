"""Stage `score`: sample completions from the SFT model, score them, turn the scores into pairs.

For every prompt, `score.n` completions are sampled through `stages.generation` (`score.generation.backend`)
and scored by the weighted reward functions of `score.reward_functions` (`stages.reward_functions`). Each prompt's
scored completions become preference pairs (best vs worst, or all pairs apart by more than
`score.min_margin`), filtered by minimum score, margin, length and duplicates; every filter's count is kept.
With `score.source: dataset` the rows of `score.dataset` (prompt + `completions`) are scored instead.
Sampling and scoring run in shards of `score.generation.batch_size` prompts; every finished shard is kept in
the work folder, so a rerun after a crash resumes from the last one, and shards can be computed apart by
processes or machines sharing `run.output_dir` (`run_shard`); the stage run then only assembles them.

Writes `pairs.jsonl`, `scores.jsonl` (every completion with its total and per-function scores) and
`histogram.json`; the filter counts and the score distribution are in the manifest.

    python -m stages score [--set score.n=8] [--set score.reward_functions=[exact_match]]
"""
from __future__ import annotations

import itertools
import json
import os
import uuid
from collections import Counter
from collections.abc import Collection
from typing import Any

import numpy as np

from stages import trackers
from stages.basics import Progress, stable_seed
from stages.completion_text import answer_after_reasoning
from stages.data import DataError, read_jsonl, write_jsonl
from stages.data.tokenize import render_prompt
from stages.generation import Generations, generate
from stages.generation.common import build_generations, eos_token_ids
from stages.models import load_causal_lm, load_tokenizer, pick_device
from stages.pipeline.prompts import backend_options, prompt_rows, reward_model_path
from stages.reward_functions import build_reward_functions, exact_match

COLUMNS_NOT_PASSED = ("prompt", "completions")
PAIR_KEYS = ("prompt", "completions", "completion", "chosen", "rejected")  # a pair row keeps the prompt's other columns


def run(ctx) -> dict[str, Any]:
    s = ctx.params.score
    if not s.enabled:
        ctx.log.info("score: disabled (score.enabled false); no pairs")
        return {"enabled": False}
    rows, sample, rewards, tokenizer, backend, seed = prepare(ctx)
    records = sample_and_score(ctx, rows, sample, rewards, tokenizer, shard_size=s.generation.batch_size)
    sample = None  # noqa: F841 (its closure holds the SFT model: freed before pairing)
    prompt_index = [r["prompt_index"] for r in records]
    texts = [r["text"] for r in records]
    totals = [r["score"] for r in records]
    lengths = [r["length"] for r in records]

    pairs, counts = build_pairs(rows, prompt_index, texts, totals, lengths, s)
    scored = [{"prompt_index": r["prompt_index"], "completion": r["text"], "answer": r["answer"], "score": r["score"],
               "finished": r["finished"], **{f"score/{name}": v for name, v in r["scores"].items()}}
              for r in records]
    write_jsonl(ctx.out / "pairs.jsonl", pairs)
    write_jsonl(ctx.out / "scores.jsonl", scored)
    hist = histogram([t for t in totals if t is not None], s.histogram_bins)
    (ctx.out / "histogram.json").write_text(json.dumps(hist, indent=2))
    quality = pair_quality(pairs) if any("answer" in r for r in rows) else None
    ctx.log.info("score: %d pairs from %d prompts; filtered %s", len(pairs), len(rows), dict(counts))
    if quality is not None:
        ctx.log.info("score: chosen answer correct in %.3f of pairs, rejected in %.3f", quality["chosen_correct"],
                     quality["rejected_correct"])
    scored_values = [t for t in totals if t is not None]
    metrics = {
        "prompts": len(rows),
        "completions": len(totals),
        "unscored": sum(t is None for t in totals),
        "pairs": len(pairs),
        "mean_score": round(float(np.mean(scored_values)), 4) if scored_values else None,
        "mean_margin": round(float(np.mean([r["chosen_score"] - r["rejected_score"] for r in pairs])), 4)
        if pairs else None,
        "filtered": dict(counts),
        "source": s.source,
        "backend": backend,
        "seed": seed,
        **({"chosen_correct": quality["chosen_correct"], "rejected_correct": quality["rejected_correct"]}
           if quality else {}),
        "histogram": hist,
    }
    trackers.log_stage_metrics(ctx.params, "score", metrics)  # into the pipeline run of the training stages' trackers
    return metrics


def run_shard(ctx, shard: int, num_shards: int) -> dict[str, Any]:
    """Sample and score share `shard` of `num_shards` of the prompt shards (those numbered k with
    k % num_shards == shard) into `ctx.work/shards/`, and assemble nothing: the stage's `run`
    afterwards (same params, so the same work folder) finds them saved and only pairs them.

    Run through `stages.harness.runner.run_shard` (`python -m stages score --shard K --num-shards N`).
    Returns {"shards": the prompt-shard numbers of this share, "sampled": how many were sampled now}.
    """
    s = ctx.params.score
    if not s.enabled:
        return {"shards": [], "sampled": 0}
    rows, sample, rewards, tokenizer, _, _ = prepare(ctx)
    mine = [k for k in range(num_prompt_shards(len(rows), s.generation.batch_size)) if k % num_shards == shard]
    sampled = []

    def counting(start: int, stop: int) -> Generations:
        sampled.append(start)
        return sample(start, stop)

    sample_and_score(ctx, rows, counting, rewards, tokenizer, shard_size=s.generation.batch_size, only=mine)
    return {"shards": mine, "sampled": len(sampled)}


def prepare(ctx) -> tuple[list[dict], Any, Any, Any, str, int]:
    """(prompt rows, sample(start, stop) -> Generations, reward functions, tokenizer, backend, seed).

    The SFT model is loaded on the first `sample` call: a run whose shards are all saved loads none.
    """
    p, s = ctx.params, ctx.params.score
    device = pick_device(p.run.device)
    sft = str(ctx.inputs["sft"] / "model")
    tokenizer = load_tokenizer(sft, trust_remote_code=p.model.trust_remote_code)
    # every reward function imported and checked before any sampling
    rewards = build_reward_functions(s.reward_functions, s.reward_weights, key="score.reward_functions",
                                     reward_model_path=reward_model_path(ctx), device=device)
    g = s.generation
    if s.source == "dataset":
        rows, everything = load_generations(s.dataset, tokenizer, s.num_prompts)

        def from_dataset(start: int, stop: int) -> Generations:
            return slice_generations(everything, start, stop)

        return rows, from_dataset, rewards, tokenizer, "dataset", everything.seed
    rows = prompt_rows(ctx, s.num_prompts)
    loaded: list[Any] = []  # the model (or, for vllm, its folder), loaded on first use

    def sample(start: int, stop: int) -> Generations:
        if not loaded:
            ctx.log.info("score: sampling %d x %d completions from %s (%s backend)", len(rows), s.n, sft, g.backend)
            loaded.append(load_causal_lm(sft, dtype=p.model.dtype, device=device,
                                         trust_remote_code=p.model.trust_remote_code) if g.backend != "vllm" else sft)
        # seeded per prompt (run seed, draw 0, the prompt's tokens): a shard sampled again after a crash, in
        # another process, or cut at other boundaries gives the same completions
        sampling = g.sampling(s.n, seed=stable_seed(p.run.seed, 0))  # draw 0
        options = backend_options(sampling, sft)
        return generate(options.pop("model", loaded[0]), tokenizer, [r["prompt"] for r in rows[start:stop]],
                        sampling, tools=[r.get("tools") for r in rows[start:stop]], **options)

    return rows, sample, rewards, tokenizer, g.backend, p.run.seed


def num_prompt_shards(num_rows: int, shard_size: int) -> int:
    return -(-num_rows // shard_size)


def sample_and_score(ctx, rows: list[dict], sample, rewards, tokenizer, *, shard_size: int,
                     only: Collection[int] | None = None) -> list[dict]:
    """One record per completion: prompts sampled (`sample(start, stop) -> Generations`) and scored in shards.

    Each finished shard of `shard_size` prompts is saved to `ctx.work/shards/NNNN.jsonl`
    (atomically); a rerun after a crash or kill reuses the saved shards and samples only the rest,
    and so does the run after `run_shard`s computed them elsewhere. `only`: just these shard
    numbers (their records are returned); None: all.
    Records: prompt_index, text (the assistant message, reasoning kept), answer (what reward
    functions scored), finished, length (prompt + completion tokens), score, scores (per function).
    """
    folder = ctx.work / "shards"
    starts = range(0, len(rows), shard_size)
    records: list[dict] = []
    mine = [k for k in range(len(starts)) if only is None or k in only]
    progress = Progress(ctx.log, total=sum(min(starts[k] + shard_size, len(rows)) - starts[k] for k in mine),
                        unit="prompts", what="score: sampled and scored")
    for k, start in enumerate(starts):
        if only is not None and k not in only:
            continue
        path, stop = folder / f"{k:04d}.jsonl", min(start + shard_size, len(rows))
        if path.exists():
            part = read_jsonl(path)
            ctx.log.info("score: shard %d/%d reused from %s (%d completions)", k + 1, len(starts), path, len(part))
        else:
            part = score_shard(rows[start:stop], sample(start, stop), rewards, tokenizer, offset=start)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # concurrent writers never share one
            folder.mkdir(parents=True, exist_ok=True)
            write_jsonl(tmp, part)
            os.replace(tmp, path)  # a shard file exists only once it is complete
            ctx.log.debug("score: shard %d/%d done (prompts %d-%d)", k + 1, len(starts), start, stop - 1)
        records += part
        progress.advance(stop - start)
    progress.finish()
    return records


def score_shard(rows: list[dict], gens: Generations, rewards, tokenizer, *, offset: int) -> list[dict]:
    """Records of one shard's completions (`gens` indexes `rows` from 0; `offset` makes the indices global)."""
    columns = gens.reward_columns(rows, skip=COLUMNS_NOT_PASSED)
    totals, per_function = rewards([rows[i]["prompt"] for i in gens.prompt_index], gens.completions, **columns)
    texts = completion_texts(tokenizer, gens.completion_ids)
    return [{"prompt_index": i + offset, "text": texts[k], "answer": gens.completions[k],
             "finished": gens.finished[k], "length": len(gens.prompt_ids[i]) + len(gens.completion_ids[k]),
             "score": totals[k], "scores": {name: v[k] for name, v in per_function.items()}}
            for k, i in enumerate(gens.prompt_index)]


def slice_generations(gens: Generations, start: int, stop: int) -> Generations:
    """The completions of prompts [start, stop) of `gens`, re-indexed from 0."""
    keep = [k for k, i in enumerate(gens.prompt_index) if start <= i < stop]
    return Generations(prompts=gens.prompts[start:stop], prompt_index=[gens.prompt_index[k] - start for k in keep],
                       prompt_ids=gens.prompt_ids[start:stop], completion_ids=[gens.completion_ids[k] for k in keep],
                       completions=[gens.completions[k] for k in keep], reasoning=[gens.reasoning[k] for k in keep],
                       finished=[gens.finished[k] for k in keep], seed=gens.seed, backend=gens.backend,
                       logprobs=None if gens.logprobs is None else [gens.logprobs[k] for k in keep])


def completion_texts(tokenizer, completion_ids: list[list[int]]) -> list[str]:
    """The assistant message as the chat template would hold it: reasoning block kept, EOS and padding dropped."""
    drop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return [tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False).strip()
            for ids in completion_ids]


def build_pairs(rows, prompt_index, texts, scores, lengths, s) -> tuple[list[dict], Counter]:
    """Per prompt: drop unscored, over-long and duplicate completions, then pair by score; count every drop."""
    counts: Counter = Counter()
    groups: dict[int, list[tuple[str, float]]] = {}
    for i, text, score, length in zip(prompt_index, texts, scores, lengths, strict=True):
        group = groups.setdefault(i, [])
        if score is None:
            counts["unscored_completions"] += 1
        elif length > s.max_length:
            counts["too_long_completions"] += 1
        elif s.dedup and any(text == t for t, _ in group):
            counts["duplicate_completions"] += 1
        else:
            group.append((text, float(score)))
    pairs = []
    for i, group in groups.items():
        candidates = pair_candidates(group, s.pairing)
        if not candidates:
            counts["prompts_without_two_completions" if len(group) < 2 else "prompts_all_tied"] += 1
            continue
        kept = [(c, r) for c, r in candidates if c[1] - r[1] > s.min_margin]
        counts["pairs_below_min_margin"] += len(candidates) - len(kept)
        if s.min_score is not None:
            before = len(kept)
            kept = [(c, r) for c, r in kept if c[1] >= s.min_score]
            counts["pairs_below_min_score"] += before - len(kept)
        extra = {k: v for k, v in rows[i].items() if k not in PAIR_KEYS}
        prompt = rows[i]["prompt"]
        for (chosen, cs), (rejected, rs) in kept:
            pairs.append({"prompt": prompt, "chosen": as_completion(prompt, chosen),
                          "rejected": as_completion(prompt, rejected), "chosen_score": cs,
                          "rejected_score": rs, **extra})
        if not kept:
            counts["prompts_without_pairs"] += 1
    return pairs, +counts


def as_completion(prompt: Any, text: str) -> Any:
    """A sampled completion in the prompt's form: one assistant message after chat messages, the plain
    string after a plain-string prompt (plain strings end to end: no chat template is needed downstream)."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def completion_text(completion: Any) -> str:
    """The text of a completion in either form (a string, or chat messages: the last one's content)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def pair_candidates(group: list[tuple[str, float]], pairing: str) -> list[tuple[tuple, tuple]]:
    """(chosen, rejected) candidates of one prompt, higher score first; ties are never pairs."""
    if len(group) < 2:
        return []
    if pairing == "best_worst":
        best, worst = max(group, key=lambda c: c[1]), min(group, key=lambda c: c[1])
        return [(best, worst)] if best[1] > worst[1] else []
    return [(a, b) if a[1] > b[1] else (b, a) for a, b in itertools.combinations(group, 2) if a[1] != b[1]]


def histogram(values: list[float], bins: int) -> dict[str, list]:
    if not values:
        return {"counts": [], "edges": []}
    counts, edges = np.histogram(np.asarray(values, dtype=float), bins=bins)
    return {"counts": counts.tolist(), "edges": [round(float(e), 6) for e in edges]}


def pair_quality(pairs: list[dict]) -> dict[str, float] | None:
    """With ground-truth answers (the built-in task): how often chosen / rejected are actually right."""
    if not pairs:
        return None

    def correct(side: str) -> float:
        answers = [answer_after_reasoning(completion_text(r[side])) for r in pairs]
        scores = exact_match([r["prompt"] for r in pairs], answers, answer=[r.get("answer") for r in pairs])
        return round(sum(x or 0.0 for x in scores) / len(pairs), 4)

    return {"chosen_correct": correct("chosen"), "rejected_correct": correct("rejected")}


def load_generations(path: str, tokenizer, limit: int) -> tuple[list[dict], Generations]:
    """Offline mode: rows of prompt + completions (list of strings) from `path`, as Generations."""
    rows = read_jsonl(path)
    for line, row in enumerate(rows, 1):
        if "prompt" not in row or not isinstance(row.get("completions"), list) or not row["completions"]:
            raise DataError(f"{path}:{line}: score.dataset rows need 'prompt' and a non-empty list 'completions' "
                            f"(got keys {sorted(row)})")
        bad = [i for i, c in enumerate(row["completions"]) if not isinstance(c, str)]
        if bad:
            raise DataError(f"{path}:{line}: completions[{bad[0]}] is not a string; completions are the assistant's "
                            "texts")
    rows = rows[:limit] if limit > 0 else rows
    eos = eos_token_ids(tokenizer)
    rendered = [render_prompt(tokenizer, r["prompt"], r.get("tools")) for r in rows]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in rendered]
    completion_ids = [[tokenizer(c, add_special_tokens=False)["input_ids"] + eos[:1] for c in r["completions"]]
                      for r in rows]
    return rows, build_generations(tokenizer, [r["prompt"] for r in rows], rendered, prompt_ids, completion_ids, eos,
                                   seed=0, backend="dataset")
