"""Trainers built on `transformers.Trainer`, TRL's names and shapes, one method per module pair:
`<method>_config.py` (the method's config: a TrainingArguments subclass with its settings, defaults and
checks, also read torch-free as params.yaml's section) and `<method>_trainer.py` (a thin trainer calling
`stages.losses`). Shared mechanics: `inputs.py` (TRL-shaped arguments: a model id or folder, the tokenizer,
`peft_config`, datasets), `pair_batches.py` (pair tokenisation, collation, sequence log-probs),
`reference_model.py` (the reference model), `online_generation.py` (sampling and seeds), `rollout.py`; the
model-forward blocks they share (`stages.logprobs`, `stages.pair_packing`, `stages.precision`) sit beside
`stages.kernels`.

    from stages.trainers import DPOConfig, DPOTrainer     # as `from trl import ...`
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "SFTConfig": "sft_config", "SFTTrainer": "sft_trainer",
    "RewardConfig": "reward_config", "RewardTrainer": "reward_trainer",
    "DPOConfig": "dpo_config", "DPOTrainer": "dpo_trainer",
    "KTOConfig": "kto_config", "KTOTrainer": "kto_trainer",
    "OnlineDPOConfig": "online_dpo_config", "OnlineDPOTrainer": "online_dpo_trainer",
    "GRPOConfig": "grpo_config", "GRPOTrainer": "grpo_trainer",
    "PPOConfig": "ppo_config", "PPOTrainer": "ppo_trainer",
    "RLOOConfig": "rloo_config", "RLOOTrainer": "rloo_trainer",
    "DistillationConfig": "distillation_config", "DistillationTrainer": "distillation_trainer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):  # imported on first use: `import stages.trainers` stays light (params validation)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stages.trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stages.trainers.{_EXPORTS[name]}"), name)
