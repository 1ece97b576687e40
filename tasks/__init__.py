"""Thin Prefect tasks, one per stage; each calls `stages.harness.runner.run_stage` and reports to the UI."""
