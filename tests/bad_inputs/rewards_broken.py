"""A reward module that fails while importing."""
raise RuntimeError("reward module misconfigured: REWARD_API_URL is not set")
