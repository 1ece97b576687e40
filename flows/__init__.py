"""Prefect flows: `align` (the pipeline) and its deployments (`align/full`, `align/nightly`)."""
