"""TRL's documented quickstarts (SFT, DPO, GRPO, KTO, reward, RLOO, distillation) on `stages.trainers`, import
line changed.

Each block is the snippet of TRL 1.16's documentation (the trainer's docstring example, and the
GRPO example of TRL's quickstart page) with three changes forced by an offline machine and a
smoke run: the import line (`from stages.trainers import ...` instead of `from trl import ...`),
`model=` a local folder (the built-in tiny Llama, saved here) instead of a hub id, and a small
`datasets.Dataset` built here in the shape of the hub dataset the snippet loads; plus `args=`
for 2 steps. SFT is TRL's quickstart (a conversational `messages` dataset, trl-lib/Capybara's shape), as
is, then with TRL's LoRA line `peft_config=LoraConfig(...)` (SFT-LoRA), then on plain text (SFT-text,
roneneldan/TinyStories); DPO adds the LoRA line too. RLOO's snippet imports
`accuracy_reward` from `trl.rewards`, which needs the `math_verify` package: a stand-in with its
signature (the completion's last number against the `solution` column) is defined here instead.
Distillation's teacher is a second local folder (a wider tiny Llama with the same tokenizer).

    python examples/trl_quickstart.py [--out DIR] [--only SFT,DPO]

Prints one JSON line per trainer: {"trainer", "loss", "finite", "changed", "trainable", "peft"}:
the training loss, whether it is finite, and how many of the trainable tensors changed.
One process on CPU; under `torchrun --nproc_per_node 2` each trainer runs data-parallel.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig

from stages.builtin import tiny

SMOKE = {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "save_strategy": "no",
         "report_to": "none", "learning_rate": 1e-3}
QUESTIONS = [f"What is {a} + {b}?" for a, b in [(2, 3), (4, 4), (7, 1), (5, 9), (6, 2), (8, 3), (1, 1), (9, 9)]]
ANSWERS = [str(eval(q[8:-1])) for q in QUESTIONS]  # noqa: S307 -- "a + b" from the list above
WRONG = [str(int(a) + 1) for a in ANSWERS]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# ---- datasets in the shapes of the hub datasets TRL's snippets load

def capybara() -> Dataset:  # trl-lib/Capybara: one "messages" column of multi-turn conversations
    return Dataset.from_dict({"messages": [user(q) + assistant(a) + user("Are you sure?") + assistant(f"Yes, {a}.")
                                           for q, a in zip(QUESTIONS, ANSWERS, strict=True)]})


def tinystories() -> Dataset:  # roneneldan/TinyStories: plain text
    return Dataset.from_dict({"text": [f"Once upon a time {q.lower()} It was {a}."
                                       for q, a in zip(QUESTIONS, ANSWERS, strict=True)]})


def ultrafeedback_binarized() -> Dataset:  # trl-lib/ultrafeedback_binarized: implicit prompt, conversational
    return Dataset.from_dict({"chosen": [user(q) + assistant(a) for q, a in zip(QUESTIONS, ANSWERS, strict=True)],
                              "rejected": [user(q) + assistant(w) for q, w in zip(QUESTIONS, WRONG, strict=True)]})


def kto_mix() -> Dataset:  # trl-lib/kto-mix-14k: prompt, completion, label; conversational
    return Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS] * 2,
                              "completion": [assistant(a) for a in ANSWERS] + [assistant(w) for w in WRONG],
                              "label": [True] * len(QUESTIONS) + [False] * len(QUESTIONS)})


def deepmath() -> Dataset:  # trl-lib/DeepMath-103K: prompt (conversational), solution
    return Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS], "solution": ANSWERS})


def tldr() -> Dataset:  # trl-lib/tldr: prompt, completion; standard (plain strings)
    return Dataset.from_dict({"prompt": QUESTIONS, "completion": ANSWERS})


# ---- the snippets

def sft(model: str, out: str):
    from stages.trainers import SFTConfig, SFTTrainer

    dataset = capybara()  # load_dataset("trl-lib/Capybara", split="train")
    trainer = SFTTrainer(
        model=model,
        train_dataset=dataset,
        args=SFTConfig(output_dir=out, **SMOKE),
    )
    return trainer


def sft_lora(model: str, out: str):
    from stages.trainers import SFTConfig, SFTTrainer

    dataset = capybara()  # load_dataset("trl-lib/Capybara", split="train")
    trainer = SFTTrainer(
        model=model,
        train_dataset=dataset,
        args=SFTConfig(output_dir=out, **SMOKE),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return trainer


def sft_text(model: str, out: str):
    from stages.trainers import SFTConfig, SFTTrainer

    dataset = tinystories()  # load_dataset("roneneldan/TinyStories", split="train[:1%]")
    trainer = SFTTrainer(
        model=model,
        train_dataset=dataset,
        args=SFTConfig(output_dir=out, max_length=512, **SMOKE),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return trainer


def dpo(model: str, out: str):
    from stages.trainers import DPOConfig, DPOTrainer

    dataset = ultrafeedback_binarized()  # load_dataset("trl-lib/ultrafeedback_binarized", split="train")
    trainer = DPOTrainer(
        model=model,
        train_dataset=dataset,
        args=DPOConfig(output_dir=out, **SMOKE),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return trainer


def grpo(model: str, out: str):
    from stages.trainers import GRPOConfig, GRPOTrainer

    # Define a simple reward function (count unique chars as example)
    def reward_function(completions, **kwargs):
        return [len(set(completion.lower())) for completion in completions]

    trainer = GRPOTrainer(
        model=model,
        train_dataset=tldr(),  # load_dataset("trl-lib/tldr", split="train")
        reward_funcs=reward_function,
        args=GRPOConfig(output_dir=out, num_generations=4, max_completion_length=16, **SMOKE),
    )
    return trainer


def kto(model: str, out: str):
    from stages.trainers import KTOConfig, KTOTrainer

    dataset = kto_mix()  # load_dataset("trl-lib/kto-mix-14k", split="train")
    trainer = KTOTrainer(
        model=model,
        train_dataset=dataset,
        args=KTOConfig(output_dir=out, **SMOKE),
    )
    return trainer


def reward(model: str, out: str):
    from stages.trainers import RewardConfig, RewardTrainer

    dataset = ultrafeedback_binarized()  # load_dataset("trl-lib/ultrafeedback_binarized", split="train")
    trainer = RewardTrainer(
        model=model,
        train_dataset=dataset,
        args=RewardConfig(output_dir=out, **SMOKE),
    )
    return trainer


def accuracy_reward(completions, solution, **kwargs):
    """trl.rewards.accuracy_reward's signature. 1.0 when the completion's last number is the solution, graded
    1 / (1 + distance) otherwise (0 without a number), so that the 2-step smoke run of an untrained model, which
    is never exactly right, still has rewards that differ within a group."""
    import re

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    last = [re.findall(r"\d+", t)[-1:] for t in texts]
    return [1 / (1 + abs(int(n[0]) - int(s))) if n else 0.0 for n, s in zip(last, solution, strict=True)]


def rloo(model: str, out: str):
    from stages.trainers import RLOOConfig, RLOOTrainer

    dataset = deepmath()  # load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        args=RLOOConfig(output_dir=out, max_completion_length=16, **SMOKE),
    )
    return trainer


def distillation(model: str, out: str):
    from stages.trainers import DistillationConfig, DistillationTrainer

    dataset = tldr()  # load_dataset("trl-lib/tldr", split="train")
    trainer = DistillationTrainer(
        model=model,
        teacher_model=str(Path(out).parent / "teacher"),  # "Qwen/Qwen2.5-1.5B-Instruct"
        train_dataset=dataset,
        args=DistillationConfig(output_dir=out, max_completion_length=16, **SMOKE),
    )
    return trainer


SNIPPETS = {"SFT": sft, "SFT-LoRA": sft_lora, "SFT-text": sft_text, "DPO": dpo, "GRPO": grpo, "KTO": kto,
            "Reward": reward, "RLOO": rloo, "Distillation": distillation}


def run(name: str, model: str, out: str) -> dict:
    """Build the snippet's trainer, train it, and report its loss and which trainable tensors changed."""
    trainer = SNIPPETS[name](model, out)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    loss = trainer.train().training_loss
    after = dict(trainer.model.named_parameters())
    changed = sum(not after[n].detach().equal(p) for n, p in before.items())
    return {"trainer": name, "loss": loss, "finite": math.isfinite(loss), "changed": changed,
            "trainable": len(before), "peft": hasattr(trainer.model, "peft_config")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the model and the runs (default: a temporary folder)")
    parser.add_argument("--only", default=",".join(SNIPPETS), help="comma-separated trainers to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trl-quickstart-") as tmp:
        out = Path(args.out or tmp)
        model = str(tiny.build(out / "tiny", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                               vocab_size=384, seed=0))
        tiny.build(out / "teacher", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=384,
                   seed=1)  # the distillation snippet's teacher: same tokenizer, another model
        for name in args.only.split(","):
            print(json.dumps(run(name, model, str(out / name))), flush=True)


if __name__ == "__main__":
    main()
