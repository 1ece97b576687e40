"""PPO benchmark: does `stages.trainers.ppo.PPOTrainer` raise the mean reward on held-out prompts?

Usage::

    python benchmarks/ppo.py                         # SFT model built under /tmp first (~2-3 min), then PPO
    python benchmarks/ppo.py --sft-model DIR --data DIR   # an SFT model folder and a preprocess folder
    python benchmarks/ppo.py --reward-model DIR      # reward: a trained reward model instead of exact_match
    python benchmarks/ppo.py --quick                 # fewer steps and prompts (smoke test)

The policy starts from the built-in task's SFT model (the default-size `builtin:tiny`
trained by `python -m stages preprocess` + `python -m stages sft`, reused from
`--work/artifacts` when already there). PPO trains on `prompts.jsonl` (prompt + answer)
with the reward `exact_match` (1 if the completion's final integer is the answer) or
`--reward-model`. Before and after, the same held-out prompts (`eval.jsonl`, disjoint from
the training prompts by preprocess's hash split) are answered greedily and, at the training
temperature, with 4 samples each; the table shows the mean reward of both, the EOS rate and
the mean completion length, and the wall time of training.

Runs on one machine (CPU or one GPU: `--device cuda`). Torch uses `--threads` threads (1 by
default: on a shared machine more threads mostly wait on each other). Timings on a shared
machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-model", help="SFT model folder (default: build one under --work)")
    p.add_argument("--data", help="preprocess folder with prompts.jsonl and eval.jsonl (default: under --work)")
    p.add_argument("--work", default="/tmp/ppo_bench", help="where the default SFT model and PPO outputs go")
    p.add_argument("--reward-model", help="a trained reward model folder (default reward: exact_match)")
    p.add_argument("--steps", type=int, default=60, help="PPO steps (one rollout batch each)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per rollout")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 steps of 16 prompts, 64 held-out prompts")
    a = p.parse_args()
    if a.quick:
        a.steps, a.batch_size, a.eval_prompts = 8, 16, 64
    return a


def sft_model_and_data(a) -> tuple[Path, Path]:
    """The given folders, or the built-in task's preprocess + sft outputs under --work (built once)."""
    out = Path(a.work) / "artifacts"
    model = Path(a.sft_model) if a.sft_model else out / "sft" / "model"
    data = Path(a.data) if a.data else out / "preprocess"
    if not a.sft_model and not (model / "model.safetensors").exists():
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        for stage in ("preprocess", "sft"):
            print(f"building the SFT model: python -m stages {stage} (into {out})", flush=True)
            subprocess.run([sys.executable, "-m", "stages", stage, "--set", f"run.output_dir={out}"], cwd=REPO,
                           env=env, check=True, stdout=subprocess.DEVNULL)
    for f in (model / "config.json", data / "prompts.jsonl", data / "eval.jsonl"):
        if not f.exists():
            sys.exit(f"{f} not found: pass --sft-model / --data, or leave them out to build them under --work")
    return model, data


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def evaluate(model, tok, rows: list[dict], reward_fn, a) -> dict[str, float]:
    """Mean reward of greedy answers and of 4 samples per prompt at the training temperature."""
    from stages.generation import SamplingParams, generate

    prompts = [r["prompt"] for r in rows]
    result = {}
    for name, sampling in (("greedy", SamplingParams(max_new_tokens=a.max_new_tokens)),
                           ("sampled", SamplingParams(max_new_tokens=a.max_new_tokens, n=4, do_sample=True,
                                                      temperature=a.temperature, seed=a.seed + 1))):
        gens = generate(model, tok, prompts, sampling, batch_size=128)
        columns = {k: [rows[i].get(k) for i in gens.prompt_index] for k in ("answer", "completion")}
        totals, _ = reward_fn([prompts[i] for i in gens.prompt_index], gens.completions, **columns,
                              completion_ids=gens.completion_ids, reasoning=gens.reasoning, finished=gens.finished)
        scored = [t for t in totals if t is not None]
        result[f"{name}_reward"] = sum(scored) / max(len(scored), 1)
        result[f"{name}_eos_rate"] = sum(gens.finished) / len(gens.finished)
        result[f"{name}_length"] = sum(map(len, gens.completion_ids)) / len(gens.completion_ids)
    return result


def main() -> None:
    a = parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from stages.models import load_causal_lm, load_tokenizer
    from stages.rewards import RewardFunctions, load_reward_function
    from transformers.trainer_callback import PrinterCallback

    from stages.trainers.online_sampling import GenerationParams
    from stages.trainers.ppo import PPOConfig, PPOTrainer

    model_dir, data = sft_model_and_data(a)
    name = "reward_model" if a.reward_model else "exact_match"
    reward_fn = RewardFunctions([(name, load_reward_function(name, reward_model_path=a.reward_model,
                                                              device=a.device))])
    train_rows = read_jsonl(data / "prompts.jsonl")
    held_out = read_jsonl(data / "eval.jsonl", a.eval_prompts)
    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), device=a.device)

    before = evaluate(model, tok, held_out, reward_fn, a)
    args = PPOConfig(output_dir=str(Path(a.work) / "ppo"), max_steps=a.steps, per_device_train_batch_size=a.batch_size,
                     learning_rate=a.lr, lr_scheduler_type="constant", logging_steps=max(a.steps // 10, 1),
                     report_to="none", save_strategy="no", disable_tqdm=True, seed=a.seed,
                     use_cpu=a.device == "cpu", num_ppo_epochs=4, num_mini_batches=2, kl_coef=a.kl_coef,
                     generation=GenerationParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens),
                     missing_eos_penalty=1.0)
    trainer = PPOTrainer(model, args=args, processing_class=tok, train_dataset=train_rows, reward_funcs=reward_fn)
    trainer.remove_callback(PrinterCallback)  # the table below shows the log
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    after = evaluate(trainer.model.pretrained_model, tok, held_out, reward_fn, a)

    print(f"\nPPO on {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters), reward "
          f"{name}, {a.steps} steps x {a.batch_size} prompts, lr {a.lr}, kl_coef {a.kl_coef}, "
          f"T {a.temperature}, {a.threads} thread(s) on {a.device}")
    print(f"held-out prompts: {len(held_out)} ({data / 'eval.jsonl'})\n")
    print(f"{'':26}{'before':>10}{'after':>10}")
    for key in before:
        print(f"{key:26}{before[key]:10.3f}{after[key]:10.3f}")
    print(f"\ntraining wall time: {wall:.1f} s ({wall / a.steps:.2f} s/step, noisy on a shared machine)")
    print("training log (every logging step):")
    keys = ("score", "kl", "entropy", "policy_loss", "value_loss", "clipfrac", "explained_variance", "eos_rate")
    print("  step " + "".join(f"{k[:11]:>12}" for k in keys))
    for h in trainer.state.log_history:
        if "score" in h:
            print(f"  {h['step']:4d} " + "".join(f"{h[k]:12.4f}" for k in keys))


if __name__ == "__main__":
    main()
