"""GRPO on the built-in arithmetic task: dev greedy accuracy before/after, and where a step's time goes.

Usage (from the repository root)::

    python benchmarks/grpo.py                       # builds preprocess + SFT artifacts first (~1-2 min)
    python benchmarks/grpo.py --artifacts /tmp/x    # reuse <dir>/preprocess and <dir>/sft/model
    python benchmarks/grpo.py --artifacts /tmp/x --set learning_rate=1e-4 --set num_generations=4
    python benchmarks/grpo.py --artifacts /tmp/x --write    # also write benchmarks/RESULTS-grpo.md
    python benchmarks/grpo.py --artifacts /tmp/x --split eval   # the chosen settings, once, on eval

The policy is the pipeline's SFT model (default params.yaml: `builtin:tiny` hidden 128, 4
layers; SFT on demonstrations that drop the carry in 70 % of the sums needing one). GRPO
(`stages.trainers.grpo.GRPOTrainer`) trains it on the `prompts.jsonl` rows (prompt + answer)
with the `exact_match` reward only. Accuracy is the `evaluate` stage's metric (greedy
decoding, the answer after the reasoning block compared with the reference) on the held-out
prompts of `--split`, before and after: `dev` (default; preprocess's dev.jsonl, disjoint from
eval and from training) is what settings are compared and chosen on; `eval` is the split the
alignment table reports, to be scored only for the settings chosen on dev (scoring every
candidate on eval and keeping the best would make eval a tuning set and its figure optimistic).

Printed: accuracy before/after, GRPO wall time, the per-step split into generation / scoring
/ training seconds (`trainer.timing`, cumulative) and tokens/s (prompt + completion tokens
of each step per second of the step; generated tokens per second of generation). Torch uses
`--threads` threads (default 1: on the shared 2-core machine 2 threads made steps ~10x
slower); wall times on a machine shared with other jobs are inflated, so the load average
before and after is printed too. `--write` keeps the hand-written "## Sweep" section of
RESULTS-grpo.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The settings proposed as params.yaml defaults (see RESULTS-grpo.md): 32 prompts x 4 completions per step,
# a cosine decay from 1.5e-4 over 150 steps, no KL; completions of this task are ~20 tokens, so 32 covers them.
DEFAULTS = {
    "num_generations": 4, "per_device_train_batch_size": 128, "learning_rate": 1.5e-4, "lr_scheduler_type": "cosine",
    "warmup_steps": 0, "max_steps": 150, "beta": 0.0, "loss_type": "grpo", "scale_rewards": "group",
    "num_iterations": 1, "generation.max_new_tokens": 32, "generation.temperature": 1.0, "generation.batch_size": 64,
}
SWEEP_MARKER = "## Sweep"


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def build_artifacts(out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for stage in ("preprocess", "sft"):
        subprocess.run([sys.executable, "-m", "stages", stage, "--set", f"run.output_dir={out}"], cwd=ROOT,
                       env=env, check=True, stdout=subprocess.DEVNULL)


def accuracy(model, tokenizer, rows: list[dict]) -> tuple[float, float]:
    """(share of exact answers, mean completion tokens) with greedy decoding, as the evaluate stage does."""
    import re

    from stages.pipeline.evaluate import extract, generate, reference_text

    pattern = re.compile(r"(-?\d+)\s*$")
    texts, lengths = generate(model, tokenizer, [r["prompt"] for r in rows], batch_size=300, max_new_tokens=32,
                              seed=0)
    correct = sum(extract(t, pattern) is not None and extract(t, pattern) == extract(reference_text(r["completion"]),
                                                                                   pattern)
                  for t, r in zip(texts, rows))
    return correct / len(rows), sum(lengths) / len(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, help="folder with preprocess/ and sft/model (built when absent)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a GRPOConfig field")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--split", choices=("dev", "eval"), default="dev",
                    help="held-out prompts to score: dev (compare and choose settings) or eval (the chosen ones)")
    ap.add_argument("--eval-n", type=int, default=300, help="score at most this many prompts of the split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="write benchmarks/RESULTS-grpo.md")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from stages.data import read_jsonl
    from stages.models import load_causal_lm, load_tokenizer
    from stages.trainers.grpo import GRPOConfig, GRPOTrainer
    from stages.trainers.online_sampling import GenerationParams

    load_before = os.getloadavg()[0]
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    if not (artifacts / "sft" / "model").is_dir():
        print(f"building preprocess + sft artifacts in {artifacts} ...", flush=True)
        start = time.perf_counter()
        build_artifacts(artifacts)
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    model_path = str(artifacts / "sft" / "model")
    prompts = read_jsonl(artifacts / "preprocess" / "prompts.jsonl")
    held_out = artifacts / "preprocess" / f"{args.split}.jsonl"
    if not held_out.is_file():
        raise SystemExit(f"{held_out} does not exist: these artifacts predate the dev split; rebuild them "
                         "(python -m stages preprocess, then sft) or pass another --artifacts folder")
    evals = read_jsonl(held_out)[: args.eval_n]
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path)

    acc_before, len_before = accuracy(model, tokenizer, evals)
    print(f"before: accuracy {acc_before:.3f} on {len(evals)} {args.split} prompts, {len_before:.1f} completion "
          "tokens", flush=True)

    settings = {**DEFAULTS, **{k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}}
    sampling = GenerationParams(**{k.partition(".")[2]: v for k, v in settings.items() if k.startswith("generation.")})
    config = GRPOConfig(**{"output_dir": tempfile.mkdtemp(prefix="grpo-run-"), "report_to": "none", "use_cpu": True,
                           "save_strategy": "no", "disable_tqdm": True, "logging_steps": 10, "seed": args.seed,
                           "generation": sampling, **{k: v for k, v in settings.items() if "." not in k}})
    trainer = GRPOTrainer(model, ["exact_match"], args=config, processing_class=tokenizer, train_dataset=prompts)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    acc_after, len_after = accuracy(model, tokenizer, evals)
    load_after = os.getloadavg()[0]

    t, steps = trainer.timing, trainer.state.global_step
    step_s = t["generation_s"] + t["scoring_s"] + t["training_s"]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {
        "settings": settings, "split": args.split, "eval_n": len(evals), "threads": args.threads, "steps": steps,
        "grpo_wall_s": round(wall, 1),
        "accuracy_before": acc_before, "accuracy_after": acc_after,
        "completion_tokens_before": round(len_before, 1), "completion_tokens_after": round(len_after, 1),
        "per_step_s": {k: round(t[k] / steps, 3) for k in ("generation_s", "scoring_s", "training_s")},
        "share": {k: round(t[k] / step_s, 3) for k in ("generation_s", "scoring_s", "training_s")},
        "tokens_per_s": round(t["tokens"] / step_s), "generated_tokens_per_s": round(t["generated_tokens"] /
                                                                                      t["generation_s"]),
        "reward_per_log": [round(x, 3) for x in rewards],
        "load_average": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    print(f"after: accuracy {acc_before:.3f} -> {acc_after:.3f} ({100 * (acc_after - acc_before):+.1f} points) "
          f"in {wall:.0f} s of GRPO ({steps} steps)")
    if args.write:
        write_results(result)


def write_results(r: dict) -> None:
    s, p, share = r["settings"], r["per_step_s"], r["share"]
    path = ROOT / "benchmarks" / "RESULTS-grpo.md"
    old = path.read_text() if path.exists() else ""
    sweep = old[old.index(SWEEP_MARKER):] if SWEEP_MARKER in old else ""
    lines = [
        "# GRPO benchmark: exact-match reward on the built-in arithmetic task", "",
        f"Command: `python benchmarks/grpo.py --split {r['split']} --write` (builds preprocess + SFT with the default "
        "params.yaml first; `--artifacts DIR` reuses them). Settings are compared on the dev split (`--split dev`, "
        "disjoint from eval and from training); eval is scored only for the settings chosen there.", "",
        f"Settings: `{json.dumps(s)}`.", "",
        f"Machine: {r['cpus']} CPUs shared with other agents' jobs, torch threads {r['threads']}, load average "
        f"{r['load_average'][0]} before and {r['load_average'][1]} after the run: wall times are inflated by the "
        "contention and vary by +-40 % between runs.", "",
        f"| {r['split']} greedy accuracy ({r['eval_n']} prompts) | before (SFT) | after GRPO | gain | GRPO steps "
        "| GRPO wall s |",
        "|---|---:|---:|---:|---:|---:|",
        f"| exact match | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | "
        f"{100 * (r['accuracy_after'] - r['accuracy_before']):+.1f} points | {r['steps']} | {r['grpo_wall_s']} |",
        "", "Per GRPO step (means over the run; share of the step in brackets):", "",
        "| generation s | scoring s | training s | tokens/s (whole step) | generated tokens/s (generation) |",
        "|---:|---:|---:|---:|---:|",
        f"| {p['generation_s']} ({share['generation_s']:.0%}) | {p['scoring_s']} ({share['scoring_s']:.0%}) | "
        f"{p['training_s']} ({share['training_s']:.0%}) | {r['tokens_per_s']} | {r['generated_tokens_per_s']} |",
        "", f"Sampled reward (mean exact match at temperature {s.get('generation.temperature')}) every 10 steps: "
        f"{', '.join(str(x) for x in r['reward_per_log'])}.", "", "",
    ]
    path.write_text("\n".join(lines) + sweep)

if __name__ == "__main__":
    main()
