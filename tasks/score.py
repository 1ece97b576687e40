"""Prefect task for stage `score` (see stages/pipeline/score.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="score", cache_policy=NO_CACHE)
def score(params: Params, upstream: list[dict] | None = None):
    """Run stage `score`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("score", params)
