"""Deployments of the `align` flow, served by one long-running process (`align serve`).

    align/full      on demand: `prefect deployment run align/full [-p overrides='["sft.learning_rate=1e-3"]']`
    align/nightly   on the cron schedule and timezone of params.yaml `run.schedule`, with the promotion
                    gate: the new merged model replaces models/production only if it is better

Both run the flow in this process's working directory against its params.yaml. Only the
stages whose params, code or inputs changed are executed; an unchanged nightly run is all
cache hits. `pause_on_shutdown=False`: stopping `serve` (SIGTERM on a redeploy) must not
silently pause the nightly schedule. One SIGTERM stops it within seconds (`BoundedRunner`).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prefect.runner import Runner
from prefect.schedules import Cron

from flows import shutdown
from flows.align import align
from stages.harness.params_loader import load_params

log = logging.getLogger("flows.deploy")


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


class BoundedRunner(Runner):
    """Prefect's Runner whose graceful stop on SIGTERM is bounded: after GRACE_S seconds the process and its
    children end (Prefect's own graceful stop has no bound, so `align serve` could outlive a SIGTERM)."""

    last_line = "align serve: stopped"

    def handle_sigterm(self, *args, **kwargs):
        shutdown.force_exit_after(shutdown.GRACE_S, "align serve", self.last_line, code=0)
        super().handle_sigterm(*args, **kwargs)


def serve_deployments(params_file: str = "params.yaml", *, last_line: str = BoundedRunner.last_line) -> None:
    """Serve both deployments until SIGTERM or Ctrl-C (what `prefect.serve` does, with the bounded stop)."""
    runner = BoundedRunner(pause_on_shutdown=False)
    runner.last_line = last_line
    deployments = build_deployments(params_file)
    for deployment in deployments:
        runner.add_deployment(deployment)
    log.info("serving %s; run one with `prefect deployment run align/full`; stop with Ctrl-C or SIGTERM",
             ", ".join(f"align/{d.name}" for d in deployments))
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        pass
