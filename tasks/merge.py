"""Prefect task for stage `merge` (see stages/pipeline/merge.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="merge", cache_policy=NO_CACHE)
def merge(params: Params, upstream: list[dict] | None = None):
    """Run stage `merge`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("merge", params)
