"""Prefect task for stage `reference` (see stages/pipeline/reference.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="reference", cache_policy=NO_CACHE)
def reference(params: Params, upstream: list[dict] | None = None):
    """Run stage `reference`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("reference", params)
