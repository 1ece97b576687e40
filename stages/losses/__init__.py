"""Pure losses: tensors in, tensors (and metrics) out. No model, no config, no I/O.

Each training method's loss lives here so it can be tested with five-element tensors; the
trainers in `stages.trainers` only gather the inputs and call these. One module per family:
`likelihood` (SFT), `preference` (DPO variants, KTO, named objectives), `rl` (KL, GRPO, PPO), `rloo`
(RLOO), `distillation` (on-policy distillation), `bradley_terry` (reward models); `numerics` holds
what they share.
"""
from stages.losses.bradley_terry import reward_loss
from stages.losses.distillation import distillation_loss, generalized_jsd
from stages.losses.likelihood import IGNORE_INDEX, SFT_LOSSES, sft_loss, sft_loss_from_logps, token_counts
from stages.losses.preference import (
    DPO_LOSSES,
    F_DIVERGENCES,
    KTO_LOSSES,
    OBJECTIVES,
    check_objective_output,
    dpo_loss,
    kto_loss,
    objective_problems,
    preference_loss,
    resolve_objective,
    sft_objective,
)
from stages.losses.rl import (
    GRPO_AGGREGATIONS,
    GRPO_POLICY_TERMS,
    GRPO_REWARD_SCALES,
    IMPORTANCE_SAMPLING_LEVELS,
    IMPORTANCE_SAMPLING_MODES,
    KL_ESTIMATORS,
    entropy_bonus,
    explained_variance,
    gae,
    grpo_advantages,
    grpo_loss,
    high_entropy_mask,
    kl_k1,
    kl_k3,
    masked_whiten,
    normalized_sum_advantages,
    off_policy_sequence_mask,
    per_token_rewards,
    ppo_loss,
    sampler_importance_weights,
    truncated_importance_weights,
    vespo_weights,
)
from stages.losses.rloo import rloo_advantages, rloo_loss

__all__ = ["DPO_LOSSES", "F_DIVERGENCES", "GRPO_AGGREGATIONS", "GRPO_POLICY_TERMS", "GRPO_REWARD_SCALES",
           "IGNORE_INDEX", "IMPORTANCE_SAMPLING_LEVELS", "IMPORTANCE_SAMPLING_MODES", "KL_ESTIMATORS", "KTO_LOSSES",
           "OBJECTIVES", "SFT_LOSSES", "check_objective_output", "distillation_loss", "dpo_loss", "entropy_bonus",
           "explained_variance", "gae", "generalized_jsd", "grpo_advantages", "grpo_loss", "high_entropy_mask",
           "kl_k1", "kl_k3", "kto_loss", "masked_whiten", "normalized_sum_advantages", "objective_problems",
           "off_policy_sequence_mask", "per_token_rewards", "ppo_loss", "preference_loss", "resolve_objective",
           "reward_loss", "rloo_advantages", "rloo_loss", "sampler_importance_weights", "sft_loss",
           "sft_loss_from_logps", "sft_objective", "token_counts", "truncated_importance_weights", "vespo_weights"]
