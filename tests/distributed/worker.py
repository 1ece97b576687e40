"""Every cell of the support matrix: a few optimizer steps of each method, full and LoRA; rank 0 saves each update.

A cell is (method, adapter): the methods of `METHODS` x {"full", "lora"}. `train(...)` runs one
cell in this process; `main` runs every cell one after the other in one launch, so one
`accelerate launch` (gloo on CPU) covers the whole matrix:

    python -m accelerate.commands.launch --config_file configs/accelerate/ddp.yaml --num_processes 2 \\
        tests/distributed/worker.py --model DIR --out DIR --batch 2

Plain SGD, a constant learning rate and no clipping, so an update is exactly -lr x the
gradient: a gradient off by a factor (a wrong normalisation over ranks, micro-batches or
tokens) shows in the update, where Adam's first step (about lr x sign) would hide it.
The online methods (online DPO, GRPO, PPO) run as in production: they sample from the
policy (backend hf) and score with real reward functions (`exact_match` plus `variety`
below, by its dotted path); nothing inside the trainers is replaced. No dropout anywhere
(LoRA dropout 0), so a row's forward does not depend on which rank or micro-batch it is in.
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
from stages.data.formats import normalise  # noqa: E402
from stages.harness.config import ArithmeticConfig, LoraParams  # noqa: E402

METHODS = ("sft", "reward", "dpo_precomputed", "dpo_live", "kto", "online_dpo", "grpo_beta0", "grpo_beta", "ppo")
ADAPTERS = ("full", "lora")
CELLS = tuple((m, a) for m in METHODS for a in ADAPTERS)
GENERATIONS = 4  # GRPO completions per prompt
NEW_TOKENS = 6
LR = {"full": 0.5, "lora": 2.0}
LORA = LoraParams(enabled=True, r=4, alpha=8, dropout=0.0)
REWARDS = ["exact_match", "tests.distributed.worker:variety"]
INSTRUCTION = "Add the two numbers below and answer with their sum only, nothing else: "


def variety(prompts: list, completions: list[str], **_) -> list[float]:
    """Distinct characters per character, in quarters: exact_match alone is 0 for every sample of an
    untrained model (nothing would be learned); this one separates some samples and ties others, so
    online DPO drops some pairs and keeps others, unevenly over ranks and micro-batches."""
    return [round(4 * len(set(c)) / (len(c) + 1)) / 4 for c in completions]


def cell_name(method: str, adapter: str) -> str:
    return f"{method}-{adapter}"


def common_args(out: Path, name: str, adapter: str, batch: int, accum: int, steps: int) -> dict:
    return dict(output_dir=str(out / f"run-{name}"), max_steps=steps, per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum, learning_rate=LR[adapter], optim="sgd",
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                seed=0, data_seed=0, dataloader_num_workers=0)


def _data(**kw) -> dict:
    cfg = ArithmeticConfig(**{"num_train": 8, "num_preference": 16, "num_eval": 4, "num_dev": 0, **kw})
    return arithmetic.generate(**dataclasses.asdict(cfg))


def sft_rows() -> list[dict]:
    """Completions of very different lengths: half keep the reasoning block, half only the answer."""
    rows = []
    for i, r in enumerate(_data(num_train=32)["sft"][:16]):
        *prompt, answer = r["messages"]
        content = answer["content"].split("</think>")[-1] if i % 2 else answer["content"]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": content}]})
    return rows


def _instructed(prompt: list[dict]) -> list[dict]:
    """The prompt with INSTRUCTION before its question: every row of a batch starts with the same tokens, so the pair
    forwards run them once (`stages.batch_prefix`, gradients through the cache) wherever a batch has 2 rows."""
    return [{**m, "content": INSTRUCTION + m["content"]} if m["role"] == "user" else m for m in prompt]


def pair_rows() -> list[dict]:
    return [{**r, "prompt": _instructed(r["prompt"])} for r in
            (normalise("preference", r) for r in _data()["preference"][:16])]


def unpaired_rows() -> list[dict]:
    """Alternating desirable / undesirable rows (chosen and rejected of the preference pairs)."""
    return [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in pair_rows()[:8] for side in ("chosen", "rejected")]


def prompt_rows() -> list[dict]:
    return [{**r, "prompt": _instructed(r["prompt"])} for r in _data(num_train=16)["prompts"][:16]]


def build(method: str, adapter: str, model_path: str, out: Path, *, batch: int, accum: int, steps: int):
    """The cell's trainer, on a fresh model from `model_path`. batch: rows (GRPO: prompts) per micro-batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.trainers.adapters import apply_lora

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    args = common_args(out, cell_name(method, adapter), adapter, batch, accum, steps)
    lora = adapter == "lora"
    if method == "reward":
        from stages.reward_model import load_reward_model
        from stages.trainers.reward_trainer import RewardConfig, RewardTrainer

        model = load_reward_model(model_path, tokenizer=tok)  # the LM's trunk + a fresh head (seeded above)
        model = apply_lora(model, LORA, task_type="SEQ_CLS") if lora else model
        return RewardTrainer(model, args=RewardConfig(**args), processing_class=tok, train_dataset=pair_rows())
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model = apply_lora(model, LORA) if lora else model
    if method == "sft":
        from stages.trainers.sft_trainer import SFTConfig, SFTTrainer

        return SFTTrainer(model, SFTConfig(**args, max_seq_length=256), processing_class=tok, train_dataset=sft_rows())
    if method.startswith("dpo"):
        from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer

        config = DPOConfig(**args, beta=0.5, precompute_ref_log_probs=method == "dpo_precomputed")
        return DPOTrainer(model, args=config, processing_class=tok, train_dataset=pair_rows())
    if method == "kto":
        from stages.trainers.kto_trainer import KTOConfig, KTOTrainer

        return KTOTrainer(model, args=KTOConfig(**args, beta=0.5), processing_class=tok,
                          train_dataset=unpaired_rows())
    if method == "online_dpo":
        from stages.trainers.online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer

        config = OnlineDPOConfig(**args, beta=0.5, max_new_tokens=NEW_TOKENS)
        return OnlineDPOTrainer(model, reward_funcs=REWARDS, args=config, processing_class=tok,
                                train_dataset=prompt_rows())
    if method.startswith("grpo"):
        from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer

        args["per_device_train_batch_size"] = batch * GENERATIONS  # counts completions
        config = GRPOConfig(**args, num_generations=GENERATIONS, loss_type="grpo", max_completion_length=NEW_TOKENS,
                            beta=0.0 if method == "grpo_beta0" else 0.2)
        return GRPOTrainer(model, REWARDS, args=config, processing_class=tok, train_dataset=prompt_rows())
    if method == "ppo":
        from stages.trainers.ppo_trainer import PPOConfig, PPOTrainer

        config = PPOConfig(**args, num_ppo_epochs=1, num_mini_batches=1, max_completion_length=NEW_TOKENS)
        return PPOTrainer(model, args=config, processing_class=tok, train_dataset=prompt_rows(), reward_funcs=REWARDS)
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def train(method: str, adapter: str, model_path: str, out: Path, *, batch: int, accum: int = 1,
          steps: int = 2) -> dict[str, torch.Tensor] | None:
    """Train one cell for `steps` optimizer steps; return {parameter: update} on rank 0 (None elsewhere)."""
    trainer = build(method, adapter, model_path, out, batch=batch, accum=accum, steps=steps)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    if not trainer.is_world_process_zero():
        return None
    return {n: (p.detach() - before[n]) for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--batch", type=int, required=True, help="rows (GRPO: prompts) per device")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cells", default=",".join(cell_name(*c) for c in CELLS))
    a = ap.parse_args(argv)
    from stages.harness.processes import shutdown_distributed

    ok = False
    try:
        for name in a.cells.split(","):
            method, adapter = name.rsplit("-", 1)
            update = train(method, adapter, a.model, a.out, batch=a.batch, steps=a.steps)
            if update is not None:
                torch.save(update, a.out / f"{name}.pt")
        ok = True
    finally:
        shutdown_distributed(barrier=ok)  # a clean exit: no rank dies tearing down a live process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
