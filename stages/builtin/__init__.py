"""The embedded default: `builtin:tiny` (model + tokenizer) and `builtin:arithmetic` (task)."""
BUILTIN_MODELS = ("builtin:tiny",)
BUILTIN_DATA = ("builtin:arithmetic",)
