"""Online DPO, GRPO and PPO with real sampling under N processes, where rank 1's rewards carry no signal.

    python -m accelerate.commands.launch --config_file configs/accelerate/ddp.yaml --num_processes 2 \\
        tests/distributed/no_skip_worker.py --model DIR --out DIR

Rank 1's pairs all tie (online DPO), its groups all score alike (GRPO: zero advantages) and
its completions are all left unscored (PPO: an empty loss mask), while rank 0's differ. Each rank writes
`<method>-rank<R>.pt`: its final weights and what it saw (pairs dropped, logged metrics). Before training
every rank also samples one target prompt inside a batch of 8 at a rank-dependent position
(`sample-rank<R>.json`), with the seed of step 0: the same prompt must give the same completions on every
rank and in one process.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # launched as a script
    sys.path.insert(0, str(ROOT))

METHODS = ("online_dpo", "grpo", "ppo")
STEPS = 2
MAX_NEW_TOKENS = 6


def prompts(n: int = 16) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{i}+{3 * i + 1}"}]} for i in range(n)]


def target_batch(rank: int) -> tuple[list, int]:
    """8 prompts with the target prompt at position 5 - 3·rank (rank 0: 5, rank 1: 2)."""
    rows = [r["prompt"] for r in prompts(16)]
    position = 5 - 3 * rank
    others = rows[8:15] if rank else rows[1:8]
    return others[:position] + [rows[0]] + others[position:], position


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def low_ids_unless_rank_1(prompts, completions, completion_ids, **_):
    """Share of tokens below id 192; on rank 1 the same 0.5 for every completion (all pairs and groups tie)."""
    if rank() == 1:
        return [0.5] * len(completions)
    return [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def low_ids_none_on_rank_1(prompts, completions, completion_ids, **_):
    """PPO's reward: as `low_ids_unless_rank_1` on rank 0; None (unscored) for every completion on rank 1."""
    if rank() == 1:
        return [None] * len(completions)
    return low_ids_unless_rank_1(prompts, completions, completion_ids)


def train(method: str, model_path: str, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    args = dict(output_dir=str(out / f"run-{method}"), max_steps=STEPS, learning_rate=0.5, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0, dataloader_num_workers=0)
    if method == "online_dpo":
        from stages.trainers.online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer

        trainer = OnlineDPOTrainer(model, reward_funcs=[("low_ids", low_ids_unless_rank_1)], processing_class=tok,
                                   train_dataset=prompts(),
                                   args=OnlineDPOConfig(**args, per_device_train_batch_size=4, beta=0.5,
                                                        max_new_tokens=MAX_NEW_TOKENS))
    elif method == "ppo":
        from stages.trainers.ppo_trainer import PPOConfig, PPOTrainer

        # chunked log-probs read lm_head outside the forward, which DDP rejects in PPO's backward ("Expected to
        # mark a variable ready only once"): not this test's subject (issue 14, item 6), so the logits path
        trainer = PPOTrainer(model, args=PPOConfig(**args, per_device_train_batch_size=4, num_ppo_epochs=1,
                                                   num_mini_batches=2, use_chunked_logprobs=False,
                                                   max_completion_length=MAX_NEW_TOKENS),
                             processing_class=tok, train_dataset=prompts(), reward_funcs=low_ids_none_on_rank_1)
    else:
        from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model, [("low_ids", low_ids_unless_rank_1)], processing_class=tok,
                              train_dataset=prompts(), args=GRPOConfig(**args, per_device_train_batch_size=8,
                                                                       num_generations=4,
                                                                       max_completion_length=MAX_NEW_TOKENS))
    trainer.train()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "log_history": trainer.state.log_history}


def sample_target(model_path: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.basics import stable_seed
    from stages.sampling import SamplingParams
    from stages.trainers.online_generation import sample_online

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    batch, position = target_batch(rank())
    gens = sample_online(model, tok, batch, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, n=2, do_sample=True),
                         seed=stable_seed(0, 0))
    return {"position": position, "completion_ids": gens.completion_ids[2 * position:2 * position + 2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    from stages.harness.processes import shutdown_distributed

    ok = False
    try:
        torch.manual_seed(0)
        for method in METHODS:
            torch.save(train(method, a.model, a.out), a.out / f"{method}-rank{rank()}.pt")
        (a.out / f"sample-rank{rank()}.json").write_text(json.dumps(sample_target(a.model)))
        ok = True
    finally:
        shutdown_distributed(barrier=ok)  # a clean exit: no rank dies tearing down a live process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
