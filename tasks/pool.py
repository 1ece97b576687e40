"""A training stage sent to a Prefect work pool: a flow run of the deployment `align-stage/<pool>`
(flows/stage_pool.py registers it; a worker of the pool runs it on its own machine), waited for."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from stages.harness import artifacts
from stages.harness.config import Params
from stages.trackers import RUN_ENV

FLOW_NAME = "align-stage"  # the flow of flows/stage_pool.py; its deployments are named after their pool
POLL_S = 1.0  # how often the waiting task asks the server for the flow run's state (Prefect's default, 5 s, adds
#               up to 5 s to every stage sent to the pool)


def run_on_pool(stage: str, params: Params) -> dict[str, Any]:
    """Run `stage` as a flow run of `align-stage/<run.launch.work_pool>` and wait; its manifest from disk."""
    from prefect.deployments import run_deployment

    pool = params.run.launch.work_pool
    name = f"{FLOW_NAME}/{pool}"
    get_run_logger().info("%s: sent to work pool %r (deployment %s)", stage, pool, name)
    env = {RUN_ENV: os.environ[RUN_ENV]} if os.environ.get(RUN_ENV) else {}  # the trackers' pipeline run name
    run = run_deployment(name=name, parameters={"stage": stage, "params": params.to_dict()}, timeout=None,
                         poll_interval=POLL_S, job_variables={"env": env} if env else None)
    if not run.state.is_completed():
        raise RuntimeError(f"{stage}: flow run {run.name} on work pool {pool!r} ended {run.state.name}: "
                           f"{run.state.message}; its logs are in the Prefect UI")
    folder = Path(params.run.output_dir) / stage
    manifest = artifacts.read_manifest(folder)
    if manifest is None:
        raise RuntimeError(f"{stage}: the work pool run completed but {folder} holds no manifest here; the pool's "
                           "workers must write to the same run.output_dir (a shared volume) or push it to the "
                           "DVC remote (`dvc push`, then `dvc pull` here)")
    return {**manifest, "executed": run.state.name != "Cached"}
