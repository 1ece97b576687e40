"""The training methods: one record each. Every list of methods is derived from `METHODS`.

A record names a method's config and trainer as "module:Class" strings, so this module imports no trainer and
params validation, the data checks and `align status` read it without torch. From it come: the params
sections (`stages.harness.config.TRAINING_SECTIONS`, `policy.<name>`, `policy.method`'s choices), what the
data must hold for it (`stages.data.sources.needs`), how the policy stage reads its rows and builds its
trainer (`stages.pipeline.policy`), the code the policy stage's fingerprint and `dvc.yaml` hash
(`stages.harness.registry`), and the TRL counterparts the compatibility test walks.

Adding a method (docs/architecture.md, "How to add a method"): its config `<name>_config.py` and trainer
`<name>_trainer.py` under `stages/trainers/`, its loss under `stages/losses/`, and one record here; then
`align params --write` and `python -m stages dvc-yaml > dvc.yaml`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["sft", "reward", "offline", "unpaired", "online", "rl", "distill"]

# What each kind trains on: sft rows; preference pairs (prompt/chosen/rejected); unpaired rows (prompt/completion/
# label, or pairs split into a desirable and an undesirable row); prompts it samples from during training.
KIND_DATA: dict[str, str] = {"sft": "sft", "reward": "pairs", "offline": "pairs", "unpaired": "unpaired",
                             "online": "prompts", "rl": "prompts", "distill": "prompts"}
# The kinds of stage `policy` (sft and reward are stages of their own, before it).
POLICY_KINDS = ("offline", "unpaired", "online", "rl", "distill")


@dataclass(frozen=True)
class Method:
    name: str  # the params section: `sft` and `reward` are stages, the others `policy.<name>` (policy.method)
    kind: Kind  # offline: pairs; unpaired: rows labelled good/bad; online: pairs sampled and ranked in training;
    # rl: rewards on sampled completions turned into a policy gradient; distill: a teacher model's next-token
    # distributions over the policy's own samples (no reward)
    config: str  # "module:Class": its config, a TrainingArguments subclass with TRL's field names
    trainer: str  # "module:Class": its trainer, TRL's signature
    reference: bool  # trains against a frozen reference model (the starting weights, or the adapter disabled)
    # its params section is `<Name>Section`, declared beside the config (stages.trainers.pipeline_section), with the
    # pipeline's defaults where they differ from the config's
    trl: str | None = None  # TRL 1.16's counterpart, "module:Class" of its trainer (None: TRL has none)

    @property
    def data(self) -> str:
        """What it trains on: sft, pairs, unpaired or prompts (KIND_DATA)."""
        return KIND_DATA[self.kind]

    @property
    def section(self) -> str:
        """Its dotted params section: sft, reward, policy.<name>."""
        return self.name if self.kind in ("sft", "reward") else f"policy.{self.name}"

    @property
    def policy(self) -> bool:
        """A choice of `policy.method`."""
        return self.kind in POLICY_KINDS

    @property
    def samples(self) -> bool:
        """Samples completions of prompts during training."""
        return self.data == "prompts"

    @property
    def scores(self) -> bool:
        """Scores its samples with reward functions (the section's reward_functions, the trainer's reward_funcs)."""
        return self.kind in ("online", "rl")

    @property
    def teacher(self) -> bool:
        """Learns from a teacher model (the section's teacher_model_name_or_path, the trainer's teacher_model)."""
        return self.kind == "distill"


_T = "stages.trainers."

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("sft", "sft", _T + "sft_config:SFTConfig", _T + "sft_trainer:SFTTrainer", reference=False,
           trl="trl:SFTTrainer"),
    Method("reward", "reward", _T + "reward_config:RewardConfig", _T + "reward_trainer:RewardTrainer",
           reference=False, trl="trl:RewardTrainer"),
    Method("dpo", "offline", _T + "dpo_config:DPOConfig", _T + "dpo_trainer:DPOTrainer", reference=True,
           trl="trl:DPOTrainer"),
    Method("kto", "unpaired", _T + "kto_config:KTOConfig", _T + "kto_trainer:KTOTrainer", reference=True,
           trl="trl:KTOTrainer"),
    Method("online_dpo", "online", _T + "online_dpo_config:OnlineDPOConfig", _T + "online_dpo_trainer:OnlineDPOTrainer",
           reference=True, trl="trl.experimental.online_dpo:OnlineDPOTrainer"),
    Method("grpo", "rl", _T + "grpo_config:GRPOConfig", _T + "grpo_trainer:GRPOTrainer", reference=True,
           trl="trl:GRPOTrainer"),
    Method("ppo", "rl", _T + "ppo_config:PPOConfig", _T + "ppo_trainer:PPOTrainer", reference=True),
    Method("rloo", "rl", _T + "rloo_config:RLOOConfig", _T + "rloo_trainer:RLOOTrainer", reference=True,
           trl="trl:RLOOTrainer"),
    Method("distillation", "distill", _T + "distillation_config:DistillationConfig",
           _T + "distillation_trainer:DistillationTrainer", reference=False, trl="trl:DistillationTrainer"),
]}


def policy_methods() -> tuple[str, ...]:
    """The choices of `policy.method`, in the table's order, then none."""
    return (*(m.name for m in METHODS.values() if m.policy), "none")


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; methods: {', '.join(METHODS)}")
    return METHODS[name]
