"""Prefect task for stage `preprocess` (see stages/pipeline/preprocess.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="preprocess", cache_policy=NO_CACHE)
def preprocess(params: Params, upstream: list[dict] | None = None):
    """Run stage `preprocess`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("preprocess", params)
