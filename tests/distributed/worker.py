"""A few optimizer steps of SFT, DPO and GRPO on the built-in tiny model; rank 0 saves each update.

Run as one process (`train(...)` from a test) or as N through `accelerate launch` (gloo on CPU):

    python -m accelerate.commands.launch --config_file configs/accelerate/ddp.yaml --num_processes 2 \\
        tests/distributed/worker.py --model DIR --out DIR --batch 4

Plain SGD, a constant learning rate and no clipping, so an update is exactly -lr x the
gradient: a gradient off by a factor (a wrong normalisation over ranks, micro-batches or
tokens) shows in the update, where Adam's first step (about lr x sign) would hide it.
GRPO trains on fixed completions and rewards stored in its rows (`make_batch` is replaced),
so 1 and N processes see the same samples; its data path, loss and gradient reduction are
the trainer's own.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # launched as a script
    sys.path.insert(0, str(ROOT))

from stages.builtin import arithmetic  # noqa: E402
from stages.config import ArithmeticConfig  # noqa: E402
from stages.data.formats import normalise  # noqa: E402

METHODS = ("sft", "dpo", "grpo")
GENERATIONS = 4
LR = {"sft": 0.5, "dpo": 0.5, "grpo": 0.5}


def common_args(out: Path, method: str, batch: int, accum: int, steps: int) -> dict:
    return dict(output_dir=str(out / f"run-{method}"), max_steps=steps, per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum, learning_rate=LR[method], optim="sgd",
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                seed=0, data_seed=0, dataloader_num_workers=0)


def sft_rows() -> list[dict]:
    """Completions of very different lengths: half keep the reasoning block, half only the answer."""
    cfg = ArithmeticConfig(num_train=64, num_preference=8, num_eval=4)
    rows = []
    for i, r in enumerate(arithmetic.generate(**dataclasses.asdict(cfg))["sft"][:32]):
        *prompt, answer = r["messages"]
        content = answer["content"].split("</think>")[-1] if i % 2 else answer["content"]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": content}]})
    return rows


def dpo_rows() -> list[dict]:
    cfg = ArithmeticConfig(num_train=8, num_preference=64, num_eval=4)
    return [normalise("preference", r) for r in arithmetic.generate(**dataclasses.asdict(cfg))["preference"]][:32]


def grpo_rows(tokenizer, n: int = 16) -> list[dict]:
    """Prompts with GENERATIONS fixed completions (random tokens ending in EOS, lengths 2..9) and rewards."""
    from stages.data.tokenize import render_prompt

    cfg = ArithmeticConfig(num_train=8, num_preference=8, num_eval=4)
    prompts = arithmetic.generate(**dataclasses.asdict(cfg))["prompts"][:n]
    g = torch.Generator().manual_seed(0)
    rows = []
    for p in prompts:
        ids = tokenizer(render_prompt(tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"]
        comps = [torch.randint(10, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 + [tokenizer.eos_token_id] for _ in range(GENERATIONS)]
        rows.append({"prompt": p["prompt"], "prompt_ids": ids, "completion_ids": comps,
                     "rewards": torch.rand(GENERATIONS, generator=g).tolist()})
    return rows


def fixed_grpo_trainer():
    from stages.trainers.grpo import GRPOTrainer, completion_tensors
    from stages.losses import grpo_advantages

    class FixedCompletions(GRPOTrainer):
        def make_batch(self, rows):
            a, tok = self.args, self.processing_class
            batch = completion_tensors([r["prompt_ids"] for r in rows for _ in r["completion_ids"]],
                                       [c for r in rows for c in r["completion_ids"]],
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            rewards = torch.tensor([x for r in rows for x in r["rewards"]])
            batch["advantages"] = grpo_advantages(rewards, a.num_generations, scale_rewards=a.scale_rewards)
            batch["loss_mask"] = batch["completion_mask"]
            return {k: v.to(a.device) for k, v in batch.items()}

    return FixedCompletions


def train(method: str, model_path: str, out: Path, *, batch: int, accum: int = 1, steps: int = 3):
    """Train `method` for `steps` optimizer steps; return {name: update} on rank 0 (None elsewhere)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = common_args(out, method, batch, accum, steps)
    if method == "sft":
        from stages.trainers.sft import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model, SFTConfig(**args, max_seq_length=256), processing_class=tok,
                             train_dataset=sft_rows())
    elif method == "dpo":
        from stages.trainers.dpo import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model, args=DPOConfig(**args, beta=0.5), processing_class=tok, train_dataset=dpo_rows())
    else:
        from stages.trainers.grpo import GRPOConfig

        args["per_device_train_batch_size"] = batch * GENERATIONS  # counts completions
        trainer = fixed_grpo_trainer()(model, ["exact_match"], processing_class=tok, train_dataset=grpo_rows(tok),
                                       args=GRPOConfig(**args, num_generations=GENERATIONS, loss_type="dapo"))
    trainer.train()
    if not trainer.is_world_process_zero():
        return None
    return {n: (p.detach() - before[n]) for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--batch", type=int, required=True, help="rows (GRPO: prompts) per device")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args(argv)
    for method in a.methods.split(","):
        update = train(method, a.model, a.out, batch=a.batch, steps=a.steps)
        if update is not None:
            torch.save(update, a.out / f"{method}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
