"""Does alignment work? Every policy method on the built-in task, side by side.

    python benchmarks/alignment.py                       # all methods, default params.yaml
    python benchmarks/alignment.py --methods dpo grpo    # a subset
    python benchmarks/alignment.py --set policy.max_steps=50

Runs the stages directly (`stages.runner.run_stage`, what every entry point calls) in a
temporary output folder: preprocess, sft, reward and score once, then `reference`,
`policy`, `merge` and `evaluate` for each method. Stages shared by the methods are cache hits after
the first. Prints the reward model's held-out accuracy, the score stage's pair quality
(share of pairs whose chosen answer is actually right), and one evaluation table: base,
SFT, then each method's policy: accuracy, mean reward-model score on the held-out prompts,
and the time of its `reference` + `policy` stages.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from stages import runner  # noqa: E402
from stages.config import POLICY_METHODS, load_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=[m for m in POLICY_METHODS if m != "none"],
                    choices=[m for m in POLICY_METHODS if m != "none"])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--output-dir", default=None, help="keep the artifacts here (default: a temporary folder)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = args.output_dir or tempfile.mkdtemp(prefix="align-alignment-")
    base = [f"run.output_dir={out}", *args.overrides]

    rows, times = [], {}
    params = load_params(ROOT / "params.yaml", base)
    for stage in ("preprocess", "sft", "reward", "score"):
        t0 = time.perf_counter()
        m = runner.run_stage(stage, params)
        times[stage] = time.perf_counter() - t0
        if stage == "reward":
            rows.append(("reward model: held-out pair accuracy", f"{m['metrics']['accuracy']:.1%} "
                         f"({m['metrics']['held_out_pairs']} pairs, ECE {m['metrics']['ece']:.3f})"))
        if stage == "score":
            s = m["metrics"]
            rows.append(("score: pairs (prompts)", f"{s['pairs']} ({s['prompts']})"))
            if "chosen_correct" in s:
                rows.append(("score: chosen answer correct / rejected correct",
                             f"{s['chosen_correct']:.1%} / {s['rejected_correct']:.1%}"))
    table = {}
    for method in args.methods:
        params = load_params(ROOT / "params.yaml", [*base, f"policy.method={method}"])
        t0 = time.perf_counter()
        runner.run_stage("reference", params)
        policy = runner.run_stage("policy", params)
        elapsed = time.perf_counter() - t0
        runner.run_stage("merge", params)
        evaluation = runner.run_stage("evaluate", params)["metrics"]["table"]
        for r in evaluation:
            if r["model"] == "merged":
                continue  # equal to the policy row (the merge stage checks its logits)
            label = method if r["model"] == "policy" else r["model"]
            table[label] = (r["accuracy"], r["n"], elapsed if r["model"] == "policy" else None,
                            policy["metrics"].get("steps") if r["model"] == "policy" else None, r.get("reward"))
    for stage, t in times.items():
        rows.append((f"stage {stage}", f"{t:.1f} s"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"\n{'model':<12} {'accuracy':>9} {'vs sft':>8} {'RM score':>9} {'train s':>8} {'steps':>6}")
    sft = table["sft"][0]
    for label, (acc, n, t, steps, reward) in table.items():
        gain = "" if label in ("base", "sft") else f"{(acc - sft) * 100:+.1f}"
        rm = "" if reward is None else f"{reward:.2f}"
        print(f"{label:<12} {acc:>9.1%} {gain:>8} {rm:>9} {'' if t is None else f'{t:.1f}':>8} {steps or '':>6}")
    print(f"\n(n = {next(iter(table.values()))[1]} held-out prompts, greedy decoding, exact match; output in {out})")


if __name__ == "__main__":
    main()
