"""Thin Prefect tasks, one per stage; each calls `stages.runner.run_stage` and reports to the UI."""
