"""The built-in reward functions' names (stages/reward_functions.py implements them): what params validation, the data
checks and the loader agree on, in a module that imports nothing."""

REWARD_BUILTINS = ("exact_match", "reasoning_format", "length_penalty", "reward_model", "reward_model_prob")
REWARD_MODEL_REWARDS = ("reward_model", "reward_model_prob")  # the built-ins that need a trained reward model
