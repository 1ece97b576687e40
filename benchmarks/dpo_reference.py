"""Reference log-probs as a cached artifact: DPO step time with them precomputed vs a live reference,
and proof that a rerun with only `beta` changed runs no reference forward at all.

    python benchmarks/dpo_reference.py                            # default params.yaml
    python benchmarks/dpo_reference.py --output-dir /tmp/a        # reuse a pipeline already built there

Runs the stages in-process (`stages.runner.run_stage`) so the reference forwards can be
counted (`stages.trainers.reference.REFERENCE_FORWARDS` counts every reference forward pass:
live, precomputed, KTO, online DPO). Three policy runs on the same pairs:
  1. precompute on (default): stage `reference` computes the log-probs once, `policy` trains;
  2. `policy.dpo.beta` changed: `reference` is a cache hit, `policy` retrains, 0 reference forwards;
  3. precompute off: the reference model runs live in every training step.
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
from stages.params_loader import load_params  # noqa: E402
from stages.trainers import reference  # noqa: E402


def timed_policy(base: list[str], extra: list[str]) -> dict:
    params = load_params(ROOT / "params.yaml", [*base, "policy.method=dpo", *extra])
    before = reference.REFERENCE_FORWARDS
    t0 = time.perf_counter()
    ref = runner.run_stage("reference", params)
    t1 = time.perf_counter()
    policy = runner.run_stage("policy", params)
    t2 = time.perf_counter()
    m = policy["metrics"]
    ref_s = t1 - t0 if ref["executed"] else 0.0
    return {"reference": "cached" if not ref["executed"] else f"{ref_s:.1f} s", "ref_s": ref_s,
            "train_s": m["train_runtime_s"],
            "policy_s": t2 - t1, "steps": m["steps"], "step_s": m["train_runtime_s"] / max(m["steps"], 1),
            "ref_forwards": reference.REFERENCE_FORWARDS - before, "loss": m["train_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = args.output_dir or tempfile.mkdtemp(prefix="align-dpo-ref-")
    base = [f"run.output_dir={out}", *args.overrides]
    params = load_params(ROOT / "params.yaml", [*base, "policy.method=dpo"])
    for stage in ("preprocess", "sft", "reward", "score"):
        runner.run_stage(stage, params)
    runs = {
        "precomputed (stage reference, first run)": timed_policy(base, []),
        "precomputed, only policy.dpo.beta changed": timed_policy(base, ["policy.dpo.beta=0.2"]),
        "live reference (precompute_ref_log_probs: false)": timed_policy(
            base, ["policy.dpo.precompute_ref_log_probs=false"]),
    }
    print("\n| run | stage reference | policy s | steps | s/step | reference forwards | train loss |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['reference']} | {r['policy_s']:.1f} | {r['steps']} | {r['step_s']:.3f} | "
              f"{r['ref_forwards']} | {r['loss']:.4f} |")
    live, pre = runs["live reference (precompute_ref_log_probs: false)"], runs[
        "precomputed (stage reference, first run)"]
    beta = runs["precomputed, only policy.dpo.beta changed"]
    # Honest totals: a first run pays for the `reference` stage too; only reruns that keep the
    # reference cached get the step-time saving whole.
    first = (pre["ref_s"] + pre["train_s"]) / live["train_s"]
    print(f"\nstep time precomputed / live: {pre['step_s'] / live['step_s']:.2f}x")
    print(f"first run, the reference stage's own {pre['ref_s']:.1f} s included: "
          f"{pre['ref_s'] + pre['train_s']:.1f} s vs {live['train_s']:.1f} s live = {first:.2f}x")
    print(f"rerun with only beta changed (reference cached): {beta['train_s']:.1f} s vs {live['train_s']:.1f} s "
          f"= {beta['train_s'] / live['train_s']:.2f}x; reference forwards in it: {beta['ref_forwards']}")

if __name__ == "__main__":
    main()
