"""The Prefect task of every stage, made from the stage table (`STAGE_TASKS`): run the stage, forward its
logs, report its metrics, mark cache hits.

Whether a stage is current is decided by its manifest (see `stages.harness.artifacts`), the same
check `python -m stages` and `dvc repro` go through. Prefect's own result cache is not
used: it would be a second cache that can drift from the files on disk (a Prefect cache
hit restores no files). A stage found current returns a Completed state named "Cached",
which is what the UI and `align run` show.

Training stages with `run.launch.num_processes` > 1 (or several machines) run through
`stages.harness.launch`: `accelerate launch` as a subprocess in its own process group, each output
line forwarded to the task's logger, `run.launch.timeout_s` enforced by killing every process
(Prefect's `timeout_seconds` cannot interrupt a blocking thread), a failure raised so the
task's retries apply. With `run.launch.work_pool` set they run as a flow run on that Prefect
work pool instead (`tasks.pool`, `flows.stage_pool`).
"""
from __future__ import annotations

import logging
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from stages.harness import launch
from stages.harness.config import Params
from stages.harness.registry import ALL_STAGES, get_stage
from stages.harness.runner import flat_metrics, inspect, run_stage
from tasks.pool import run_on_pool
from tasks.report import publish_promotion, publish_report

# What a stage shows in the UI after it ran or was found current, beyond its metrics table.
AFTER_RUN = {"evaluate": publish_report, "promote": publish_promotion}


def stage_task(name: str) -> Task:
    """The task running stage `name`: `task(params, upstream_manifests)`; the manifests only draw the DAG edges."""
    def run(params: Params, upstream: list[dict] | None = None):
        result = run_stage_task(name, params)
        if name in AFTER_RUN:
            AFTER_RUN[name](params)
        return result

    run.__name__ = run.__qualname__ = name  # Prefect keys a task by its function's name and code
    run.__doc__ = f"Run stage `{name}` ({get_stage(name).entry}); the `upstream` manifests only draw the DAG edges."
    return task(name=name, cache_policy=NO_CACHE)(run)


class _ToPrefect(logging.Handler):
    def __init__(self, logger):
        super().__init__(logging.INFO)
        self.target = logger

    def emit(self, record: logging.LogRecord) -> None:
        self.target.log(record.levelno, "%s", record.getMessage())


def run_stage_task(name: str, params: Params):
    """Body of every stage task: returns the stage's manifest, in a "Cached" state if nothing ran."""
    handler = _ToPrefect(get_run_logger())
    logger = logging.getLogger("stages")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    propagate, logger.propagate = logger.propagate, False  # else Prefect's root handler prints each line twice
    try:
        manifest = execute(name, params)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    if not manifest["executed"]:
        return Completed(name="Cached", message=f"{name} is current (fingerprint {manifest['fingerprint']})",
                         data=manifest)
    report(name, manifest)
    return manifest


def execute(name: str, params: Params) -> dict[str, Any]:
    """Run the stage here, through accelerate launch, or on the training work pool (its manifest either way)."""
    if get_stage(name).trains and params.run.launch.work_pool and not inspect(name, params).current:
        return run_on_pool(name, params)  # a current stage is found so here (shared run.output_dir), sent nowhere
    if launch.needs_launch(name, params.run.launch):
        log = get_run_logger()
        return launch.launch_stage(name, params, on_line=lambda line: log.info("%s", line))
    return run_stage(name, params)


def report(name: str, manifest: dict[str, Any]) -> None:
    """The stage's metrics as a table artifact, and its manifest summary as markdown, in the Prefect UI."""
    metrics = manifest.get("metrics", {})
    table = metrics.get("table") or [{"metric": k, "value": v} for k, v in flat_metrics(metrics).items()]
    key = f"{name}-metrics".replace("_", "-").lower()
    create_table_artifact(key=key, table=table, description=f"{name}: metrics of fingerprint {manifest['fingerprint']}")
    lines = [f"# {name}", "", f"- fingerprint: `{manifest['fingerprint']}`",
             f"- outputs hash: `{manifest['outputs']['hash']}`", f"- wall time: {manifest['wall_time_s']} s",
             f"- code: `{manifest['code']['hash'][:16]}` (git {manifest['code'].get('git')})"]
    lines += [f"- input `{u}`: `{i['fingerprint']}`" for u, i in manifest.get("inputs", {}).items()]
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in flat_metrics(metrics).items()]
    create_markdown_artifact(key=f"{name}-manifest".replace("_", "-").lower(), markdown="\n".join(lines))


STAGE_TASKS: dict[str, Task] = {name: stage_task(name) for name in ALL_STAGES}
