"""User reward functions that misbehave (the bad-input suite points score.reward_functions here)."""


def wrong_length(prompts, completions, **_):
    return [1.0]


def strings(prompts, completions, **_):
    return ["good"] * len(completions)


def nan_scores(prompts, completions, **_):
    return [float("nan")] * len(completions)


NOT_CALLABLE = 3.0
