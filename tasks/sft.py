"""Prefect task for stage `sft` (see stages/pipeline/sft.py)."""
from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from tasks.common import run_stage_task


@task(name="sft", cache_policy=NO_CACHE)
def sft(params: Params, upstream: list[dict] | None = None):
    """Run stage `sft`; the `upstream` manifests only draw the DAG edges in the UI."""
    return run_stage_task("sft", params)
