"""The benchmark suite: `python -m benchmarks <name> [args]` from the repository root (see __main__.py)."""
