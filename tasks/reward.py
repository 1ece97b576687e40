"""Prefect task for stage `reward` (see stages/pipeline/reward.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="reward", cache_policy=NO_CACHE)
def reward(params: Params, upstream: list[dict] | None = None):
    """Run stage `reward`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("reward", params)
