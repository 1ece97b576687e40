"""Deployments of the `align` flow, served by one long-running process (`align serve`).

    align/full      on demand: `prefect deployment run align/full [-p overrides='["sft.learning_rate=1e-3"]']`
    align/nightly   on the cron schedule and timezone of params.yaml `run.schedule`, with the promotion
                    gate: the new merged model replaces models/production only if it is better

Both run the flow in this process's working directory against its params.yaml. Only the
stages whose params, code or inputs changed are executed; an unchanged nightly run is all
cache hits. `pause_on_shutdown=False`: stopping `serve` (SIGTERM on a redeploy) must not
silently pause the nightly schedule.
"""
from __future__ import annotations

from pathlib import Path

from prefect import serve
from prefect.schedules import Cron

from flows.align import align
from stages.config import load_params


def build_deployments(params_file: str = "params.yaml") -> list:
    params = load_params(params_file)
    path = str(Path(params_file).resolve())
    full = align.to_deployment(name="full", parameters={"params_file": path},
                               description="The whole pipeline, on demand.")
    nightly = align.to_deployment(
        name="nightly", parameters={"params_file": path, "promote": True}, concurrency_limit=1,
        schedule=Cron(params.run.schedule.cron, timezone=params.run.schedule.timezone),
        description="Retrains what changed since the last run, every night.")
    return [full, nightly]


def serve_deployments(params_file: str = "params.yaml") -> None:
    serve(*build_deployments(params_file), pause_on_shutdown=False)
