"""Prefect tasks for the shards of stages `score` and `evaluate` (see `stages.harness.runner.run_shard`).

With `run.parallel_shards` = N > 1 the flow first fans a stage's independent work out as N
`stage_shard` tasks through its task runner (score: the prompt shards; evaluate: the models),
waits for them, then runs the stage itself, which finds every shard saved in its work folder
and only assembles and seals the output.

Each shard runs as its own `python -m stages <stage> --shard K --num-shards N` process:
sampling seeds torch's process-wide RNG, so shards sampled in threads of one process would not
reproduce the sequential run. With the flow's default ThreadPoolTaskRunner those processes run
on this machine; with `run.dask_address` set they go to that Dask cluster's workers instead
(tasks/cluster.py), which need this code and `run.output_dir` on shared storage (README "Scale out").
"""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.task_runners import TaskRunner

from stages.harness.config import Params
from stages.harness.runner import inspect, run_shard_process


@task(name="shard", cache_policy=NO_CACHE, task_run_name="{name}-shard-{shard}-of-{num_shards}")
def stage_shard(name: str, params: Params, shard: int, num_shards: int, upstream: list[dict] | None = None
                ) -> dict:
    """Compute share `shard` of `num_shards` of stage `name` into its work folder; the `upstream`
    manifests only draw the DAG edges in the UI."""
    log = get_run_logger()
    run_shard_process(name, params, shard, num_shards, on_line=lambda line: log.info("%s", line))
    return {"stage": name, "shard": shard, "num_shards": num_shards}


def fan_out(name: str, params: Params, upstream: list[dict], runner: TaskRunner | None = None) -> list[dict]:
    """`upstream`, plus the results of stage `name`'s `run.parallel_shards` shard tasks, run at once
    through `runner` (None: the flow's task runner) and all finished; no tasks when that is 1 or the
    stage is current."""
    n = params.run.parallel_shards
    if n <= 1 or inspect(name, params).current:
        return upstream
    calls: list[dict[str, Any]] = [{"name": name, "params": params, "shard": k, "num_shards": n, "upstream": upstream}
                                   for k in range(n)]
    futures = [runner.submit(stage_shard, c) if runner else stage_shard.submit(**c) for c in calls]
    wait(futures)  # every shard ends before a failed one's error is raised
    return upstream + [f.result() for f in futures]
