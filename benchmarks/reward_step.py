"""Where a `reward` stage step spends its time on CPU: the stage's trainer against the bare step inside it.

    OMP_NUM_THREADS=1 python benchmarks/reward_step.py          # ~1 minute

The reward stage is the longest of the cold pipeline (README Figures). This times one of its optimizer steps on
`builtin:tiny` as params.yaml builds it (random weights: the arithmetic is what an SFT trunk costs) and the
built-in preference pairs, at the stage's batch size and learning rate. Each case is the median CPU time of
`--steps` steps (after 3 warm-up steps), best of `--rounds` alternated rounds:

- the stage's trainer (`RewardTrainer`, built as the stage builds it: `training.trainer_args` of the reward
  section), timed from one step's end to the next: collation, forward, loss, metric gathers, backward, AdamW,
  scheduler and callbacks;
- the bare step on the same batches: `sequence_rewards` (pairs packed on their shared prefix), `reward_loss`,
  backward, AdamW; and the same with the padded rows (no pair packing);
- the trainer with `reward.mixed_precision=bf16` (the stage's own bf16 path);
- an experiment, not a stage option: the bare step with the embeddings and the lower half of the decoder
  blocks frozen (the backward stops halfway).

The trainer's share that is not the bare step is its per-step overhead.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WARMUP = 3


def load_params_with(overrides: dict):
    """params.yaml with `overrides` (dotted keys)."""
    from stages.params_loader import load_params

    return load_params(ROOT / "params.yaml", overrides)


def pair_rows(p, n: int) -> list[dict]:
    from stages.builtin import arithmetic

    b = p.data.builtin
    rows = arithmetic.generate(num_train=1, num_preference=n, num_eval=b.num_eval, num_dev=b.num_dev,
                               digits=b.digits, error_rate=b.error_rate, reasoning=b.reasoning, seed=b.seed)
    return rows["preference"]


def freeze_lower(model, k: int) -> None:
    """Freeze a Llama-layout reward model's embeddings and its lowest `k` decoder blocks (an experiment)."""
    for module in [model.model.embed_tokens, *model.model.layers[:k]]:
        module.requires_grad_(False)


def trainer_step(path: str, tok, rows: list[dict], steps: int, overrides: dict) -> float:
    """Median CPU seconds between consecutive step ends of the reward stage's trainer."""
    from transformers import PrinterCallback, TrainerCallback

    from stages.pipeline import training
    from stages.trainers.reward import RewardConfig, RewardTrainer, load_reward_model

    p = load_params_with(overrides)
    r = p.reward
    model = load_reward_model(path, tok)
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.process_time())

    with tempfile.TemporaryDirectory() as work:
        ctx = types.SimpleNamespace(work=Path(work), log=logging.getLogger("reward_step"), params=p)
        args = training.trainer_config(RewardConfig, r, {
            **training.trainer_args(ctx, r, device="cpu", section="reward"),
            "max_steps": WARMUP + steps, "report_to": [], "save_strategy": "no", "disable_tqdm": True})
        trainer = RewardTrainer(model, args=args, processing_class=tok, train_dataset=rows, callbacks=[StepEnds()])
        trainer.remove_callback(PrinterCallback)  # as the stage does (training.train)
        trainer.train()
    return statistics.median(b - a for a, b in zip(ends[WARMUP - 1:], ends[WARMUP:]))


def bare_step(path: str, tok, batches: list[dict], *, pairs: bool = True, frozen_half: bool = False) -> float:
    """Median CPU seconds of forward + loss + backward + AdamW on `batches` (one step each, warm-ups first)."""
    from stages.losses import reward_loss
    from stages.trainers.reward import load_reward_model, sequence_rewards

    p = load_params_with({})
    model = load_reward_model(path, tok)
    model.train()
    if frozen_half:
        freeze_lower(model, len(model.model.layers) // 2)
    opt = torch.optim.AdamW([w for w in model.parameters() if w.requires_grad], lr=p.reward.learning_rate)
    times = []
    for i, batch in enumerate(batches):
        t = time.process_time()
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], pairs=pairs)
        loss, _ = reward_loss(*rewards.chunk(2))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.process_time() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from threads import builtin_model

    from stages.models import load_tokenizer
    from stages.trainers.reward import RewardCollator, tokenize_pairs

    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    p = load_params_with({})
    b = p.reward.per_device_train_batch_size
    rows = pair_rows(p, b * (WARMUP + args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        path = builtin_model(Path(tmp))
        tok = load_tokenizer(path)
        features = tokenize_pairs(tok, rows, p.reward.max_length)
        collate = RewardCollator(tok.pad_token_id)
        batches = [collate(features[i:i + b]) for i in range(0, len(features), b)]
        cases = {
            "trainer, the stage's step": lambda: trainer_step(path, tok, rows, args.steps, {}),
            "bare step, pairs packed": lambda: bare_step(path, tok, batches),
            "bare step, padded rows": lambda: bare_step(path, tok, batches, pairs=False),
            "trainer, reward.mixed_precision=bf16": lambda: trainer_step(path, tok, rows, args.steps,
                                                                         {"reward.mixed_precision": "bf16"}),
            "bare step, lower half frozen": lambda: bare_step(path, tok, batches, frozen_half=True),
        }
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, fn in cases.items():  # alternated: every case sees the same load over the rounds
                best[name] = min(fn(), best.get(name, float("inf")))
    tokens = sum(int(x["attention_mask"].sum()) for x in batches) / len(batches)
    print(f"builtin:tiny reward model, batch {b} pairs ({tokens:.0f} padded-row tokens a step), "
          f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.2f}")
    base = best["trainer, the stage's step"]
    for name, seconds in best.items():
        print(f"{name:<40} {1e3 * seconds:8.2f} ms  {seconds / base:5.2f} of the trainer's step")
    overhead = base - best["bare step, pairs packed"]
    print(f"trainer overhead per step: {1e3 * overhead:.2f} ms ({overhead / base:.0%})")


if __name__ == "__main__":
    main()
