"""Trainers built on `transformers.Trainer`, one method per module, split the same way every time:
`<method>_params.py` (the method's settings, defaults and checks, shared with params.yaml; no torch),
`<method>.py` (its config = those params + TrainingArguments, and a thin trainer calling `stages.losses`).
Shared mechanics: `inputs.py` (TRL-shaped arguments: a model id or folder, the tokenizer, peft_config,
datasets), `preference.py` (pair tokenisation, collation, sequence log-probs), `reference.py` (the
reference model), `online_sampling.py` (sampling settings and seeds), `rollout.py`, `logprobs.py`.

`from stages.trainers import SFTTrainer, SFTConfig, ...` gives what `from trl import ...` gives for
these methods (online DPO and PPO too, which TRL 1.16 keeps in `trl.experimental`). The trainers
are imported on first use, so the torch-free `*_params` modules stay importable without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "SFTTrainer": "sft", "SFTConfig": "sft",
    "RewardTrainer": "reward", "RewardConfig": "reward",
    "DPOTrainer": "dpo", "DPOConfig": "dpo",
    "KTOTrainer": "kto", "KTOConfig": "kto",
    "OnlineDPOTrainer": "online_dpo", "OnlineDPOConfig": "online_dpo",
    "GRPOTrainer": "grpo", "GRPOConfig": "grpo",
    "PPOTrainer": "ppo", "PPOConfig": "ppo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stages.trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"stages.trainers.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
