"""Stage `evaluate`: greedy generation on the held-out prompts, exact match of the extracted answer.

Evaluates the policy model (the end of the pipeline), the SFT model it started from and
(with `evaluate.baseline`) the untrained base model, so the table always shows what each
stage bought. Writes `metrics.json` (one row per model) and
`predictions.jsonl` (every prompt, completion, extracted answer and verdict).

    python -m stages evaluate [--set evaluate.max_samples=100]
"""
from __future__ import annotations

import json
import re
from typing import Any

from stages import generation
from stages.data import read_jsonl, write_jsonl
from stages.generation import SamplingParams
from stages.models import load_causal_lm, load_tokenizer, pick_device, resolve_model
from stages.utils import answer_after_reasoning


def run(ctx) -> dict[str, Any]:
    p, e = ctx.params, ctx.params.evaluate
    device = pick_device(p.run.device)
    rows = read_jsonl(ctx.inputs["preprocess"] / "eval.jsonl")
    if e.max_samples > 0:
        rows = rows[: e.max_samples]
    pattern = re.compile(e.answer_regex) if e.answer_regex else None
    models = {"sft": str(ctx.inputs["sft"] / "model")}
    if (ctx.inputs["policy"] / "model").is_dir():  # absent with policy.method: none
        models["policy"] = str(ctx.inputs["policy"] / "model")
    if e.baseline:
        models = {"base": resolve_model(p.model, p.run.output_dir), **models}

    table, predictions = [], []
    for label, path in models.items():
        tokenizer = load_tokenizer(path, trust_remote_code=p.model.trust_remote_code)
        model = load_causal_lm(path, dtype=p.model.dtype, device=device, trust_remote_code=p.model.trust_remote_code)
        completions, lengths = generate(model, tokenizer, [r["prompt"] for r in rows], batch_size=e.batch_size,
                                        max_new_tokens=e.max_new_tokens, seed=p.run.seed)
        correct = 0
        for row, completion in zip(rows, completions):
            reference = reference_text(row["completion"])
            answer, expected = extract(completion, pattern), extract(reference, pattern)
            ok = answer is not None and answer == expected
            correct += ok
            predictions.append({"model": label, "prompt": row["prompt"], "reference": reference,
                                "completion": completion, "answer": answer, "expected": expected, "correct": ok})
        table.append({"model": label, "accuracy": round(correct / max(len(rows), 1), 4), "n": len(rows),
                      "mean_completion_tokens": round(sum(lengths) / max(len(lengths), 1), 2)})
        ctx.log.info("evaluate: %s accuracy %.3f on %d prompts", label, table[-1]["accuracy"], len(rows))
        del model

    write_jsonl(ctx.out / "predictions.jsonl", predictions)
    (ctx.out / "metrics.json").write_text(json.dumps(table, indent=2))
    by_model = {r["model"]: r for r in table}
    final = by_model.get("policy", by_model["sft"])
    return {"accuracy": final["accuracy"], "sft_accuracy": by_model["sft"]["accuracy"],
            "baseline_accuracy": by_model["base"]["accuracy"] if "base" in by_model else None,
            "n": len(rows), "table": table}


def generate(model, tokenizer, prompts: list, *, batch_size: int, max_new_tokens: int, seed: int
             ) -> tuple[list[str], list[int]]:
    """Greedy completions (stripped of padding, EOS and reasoning blocks) and their token lengths (EOS included)."""
    gens = generation.generate(model, tokenizer, prompts, SamplingParams(max_new_tokens=max_new_tokens, seed=seed),
                               batch_size=batch_size)
    return gens.completions, [len(ids) for ids in gens.completion_ids]


def reference_text(completion: Any) -> str:
    if isinstance(completion, list):
        return completion[-1]["content"]
    return completion


def after_reasoning(text: str) -> str:
    """A reference's answer part, by the reasoning-block policy of `stages.utils` ("" if a block is left open)."""
    return answer_after_reasoning(text)


def extract(text: str, pattern: re.Pattern | None) -> str | None:
    """The answer in `text`: the regex's first group (reasoning blocks already stripped), or the stripped text."""
    text = after_reasoning(text)
    if pattern is None:
        return text.strip() or None
    m = pattern.search(text.strip())
    return m.group(1) if m else None
