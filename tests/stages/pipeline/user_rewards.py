"""A user's reward function, named in params by its dotted path (tests.stages.pipeline.user_rewards:distinct_tokens)."""


def distinct_tokens(prompts, completions, completion_ids=None, **columns):
    """Distinct token ids per completion: varies within a group even when every sample is cut at max tokens."""
    return [float(len(set(ids))) for ids in completion_ids]
