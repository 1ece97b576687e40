"""How an SFT model of the built-in task samples carry sums: how often it writes the carry, and whether the
column sum after a written carry is right (`stages.builtin.arithmetic_errors.error_kind`).

    python benchmarks/carry.py artifacts/sft/model artifacts/preprocess/prompts.jsonl
    python benchmarks/carry.py DIR/seed-1/shared/sft/model DIR/seed-1/shared/preprocess/prompts.jsonl --prompts 400

Samples `--n` completions at temperature 1 (the `score` stage's sampling) of the first `--prompts` carry
sums of a prompts file and prints P(carry written) and P(column sums right | carry written).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stages.builtin.arithmetic import THINK_CLOSE, THINK_OPEN, needs_carry  # noqa: E402
from stages.builtin.arithmetic_errors import error_kind  # noqa: E402
from stages.data import read_jsonl  # noqa: E402


def operands(prompt) -> tuple[int, int]:
    return tuple(map(int, re.fullmatch(r"(\d+)\+(\d+)", prompt[-1]["content"]).groups()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts", help="preprocess's prompts.jsonl")
    ap.add_argument("--prompts", dest="count", type=int, default=400, help="carry sums sampled")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    args = ap.parse_args(argv)
    import torch

    from stages.generation import SamplingParams, generate
    from stages.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    carry = [r["prompt"] for r in read_jsonl(Path(args.prompts)) if needs_carry(*operands(r["prompt"]))][:args.count]
    tok, model = load_tokenizer(args.model), load_causal_lm(args.model)
    g = generate(model, tok, carry, SamplingParams(max_new_tokens=32, n=args.n, temperature=1.0, seed=0,
                                                    do_sample=True), batch_size=100)
    kinds = Counter()
    for i, text, reasoning in zip(g.prompt_index, g.completions, g.reasoning):
        full = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{text}" if reasoning is not None else text
        kinds[error_kind(*operands(carry[i]), full) or "right"] += 1
    written = kinds["right"] + kinds["right steps, wrong answer"] + kinds["carry written, wrong sum"]
    print(f"{args.model}: {len(carry)} carry sums x {args.n}: P(carry written) {written / sum(kinds.values()):.3f}, "
          f"P(column sums right | carry written) {(written - kinds['carry written, wrong sum']) / max(1, written):.3f}"
          f"; {dict(kinds)}")


if __name__ == "__main__":
    main()
