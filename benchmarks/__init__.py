"""Benchmarks: each module prints its figures (`python -m benchmarks.<name>`); see benchmarks/RESULTS-*.md."""
