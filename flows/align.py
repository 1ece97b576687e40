"""The `align` flow: the pipeline as a DAG of cached, versioned stages.

    preprocess -> sft -> reward -> score -> reference -> policy -> merge -> evaluate [-> promote]

The DAG is the stage table, stages/harness/registry.py: each stage's task (tasks/stage.py) runs after its `upstream`
stages, in the table's order. Each task finishes "Cached" when its stage's output folder is current (same
params, code and inputs, files intact), so rerunning the flow only executes what changed downstream of a
change. With `promote=True` (the nightly deployment) the merged model replaces models/production only if it is
better. With `run.parallel_shards` > 1, the work of the stages with shards (score's prompts, evaluate's
models) is first computed by that many shard tasks at once (tasks/shards.py): in processes of this machine, or
on the workers of the Dask cluster at `run.dask_address` (tasks/cluster.py). Run it with `align run`, or
through the deployments (`align serve`, then `prefect deployment run align/full`).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.dvc_sync import record_in_dvc_lock
from stages.harness.config import Params
from stages.harness.params_loader import load_params
from stages.harness.registry import ON_REQUEST, STAGES
from stages.harness.runner import output_dir
from stages.trackers import RUN_ENV
from tasks.cluster import shard_runner
from tasks.shards import fan_out
from tasks.stage import STAGE_TASKS


# Runs the shard tasks (run.parallel_shards: that many at once) unless run.dask_address sends them to a cluster.
# prefect types TaskRunner invariant in its future type, so flow() refuses its own ThreadPoolTaskRunner
@flow(name="align", task_runner=ThreadPoolTaskRunner())  # type: ignore[arg-type]
def align(params_file: str = "params.yaml", overrides: list[str] | None = None, promote: bool = False
          ) -> dict[str, Any]:
    """Run the pipeline on `params_file` with `overrides` (["sft.learning_rate=1e-4", ...]); `promote`: then stage
    promote, the promotion gate (stages/pipeline/promote.py)."""
    params = load_params(params_file, overrides or [], rows=True)  # every params and row problem, before any compute
    with pipeline_run_name():
        return _run(params, params_file, overrides, promote)


@contextmanager
def pipeline_run_name():
    """Name this pipeline run for the trackers (`align-<flow run>`, stages/trackers.py) while the flow runs:
    its stages, in threads of this process or in subprocesses (accelerate launch, shards), read it from the
    environment. A name already set by the caller is kept."""
    from prefect.runtime import flow_run

    previous = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = previous or f"align-{flow_run.name}"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_ENV, None)


def _run(params: Params, params_file: str, overrides: list[str] | None, promote: bool) -> dict[str, Any]:
    runs: dict[str, Any] = {}  # stage -> its Prefect state

    def after(*names: str) -> list[dict]:  # upstream manifests: the DAG edges; a failed one stops here
        return [runs[n].result() for n in names]

    with shard_runner(params) as shard_tasks:  # an unreachable run.dask_address fails here, before any stage
        for spec in STAGES.values():  # the table's order: a stage's upstream stages come before it
            upstream = after(*spec.upstream)
            if spec.shards:
                upstream = fan_out(spec.name, params, upstream, shard_tasks)
            runs[spec.name] = STAGE_TASKS[spec.name](params, upstream, return_state=True)

        if promote:
            spec = ON_REQUEST["promote"]
            runs[spec.name] = STAGE_TASKS[spec.name](params, after(*spec.upstream), return_state=True)

    summary = summarise(runs, params)
    if promote:
        state = runs["promote"]  # a cached promote is an earlier run's decision on these same outputs
        summary["promotion"] = {**state.result()["metrics"], "cached": state.name == "Cached"}
    record_in_dvc_lock(params_file, params.run.output_dir, overrides,
                       executed=any(s["status"] == "executed" for s in summary["stages"]))
    create_table_artifact(key="align-run", table=summary["stages"], description="stages of this run")
    get_run_logger().info("evaluation: %s", summary["evaluation"])
    return summary


def summarise(runs: dict, params: Params) -> dict[str, Any]:
    """One row per stage, in pipeline order; a cached stage built nothing in this run: wall time 0 s (its build
    time is in its manifest)."""
    stages = []
    for name, state in runs.items():
        manifest, cached = state.result(), state.name == "Cached"
        stages.append({"stage": name, "status": "cached" if cached else "executed",
                       "fingerprint": manifest["fingerprint"],
                       "wall_time_s": 0.0 if cached else manifest["wall_time_s"]})
    # the table as the stage wrote it: its columns in the stage's order (the manifest's are sorted)
    evaluation = json.loads((output_dir(params, "evaluate") / "metrics.json").read_text())
    return {"stages": stages, "evaluation": evaluation}
