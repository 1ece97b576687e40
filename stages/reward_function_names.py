"""The built-in reward functions: the one list of them, in a module that imports nothing, so that params validation,
the data checks and `align status` read it without torch.

Each name maps to the callable of stages/reward_functions.py that implements it, named as a string (importing that
module would import torch); `reward_functions.BUILTIN_REWARDS` looks each one up there, so a name without its
callable fails as that module loads. Adding a built-in is the function there and one line here.
"""

BUILTIN_REWARD_CALLABLES = {
    "exact_match": "exact_match",
    "reasoning_format": "reasoning_format",
    "length_penalty": "length_penalty",
    "reward_model": "RewardModelReward",  # built by load_reward_function from reward_model_path
    "reward_model_prob": "RewardModelReward",  # the same, squash=True
}
REWARD_BUILTINS = tuple(BUILTIN_REWARD_CALLABLES)
# the built-ins that need a trained reward model
REWARD_MODEL_REWARDS = tuple(n for n, f in BUILTIN_REWARD_CALLABLES.items() if f == "RewardModelReward")
# The verifiable reward decides and the reward model breaks ties: score's default, and online DPO's and PPO's.
# The reward model squashed, σ(r) in (0, 1), at weight 0.5: a right answer scores at least 1, a wrong one under
# 0.5 (score.min_score), whatever scale the reward model learnt (stages.reward_functions.RewardModelReward).
VERIFIED_FIRST = ("exact_match", "reward_model_prob")
VERIFIED_FIRST_WEIGHTS = (1.0, 0.5)
