"""Prefect task for stage `policy` (see stages/pipeline/policy.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="policy", cache_policy=NO_CACHE)
def policy(params: Params, upstream: list[dict] | None = None):
    """Run stage `policy`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("policy", params)
