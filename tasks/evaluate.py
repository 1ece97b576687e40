"""Prefect task for stage `evaluate` (see stages/pipeline/evaluate.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(params: Params, upstream: list[dict] | None = None):
    """Run stage `evaluate`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("evaluate", params)
