"""Training stages on a Prefect work pool: the `align-stage` flow and its deployments (the `align` flow's
call to them, when `run.launch.work_pool` is set, is tasks/pool.py).

The `align` flow runs where it is started. With `run.launch.work_pool = gpu`, its training
stages (those with `StageSpec.training_rows`: sft, reward, policy) become flow runs of the
deployment `align-stage/gpu`, which a worker of the pool `gpu` picks up on its own machine;
the parent task waits for it and fails with it (so its retries apply). Inside, the stage runs as usual: in-process, or through
`accelerate launch` when `run.launch.num_processes` > 1. Outputs must be visible to both
sides: a shared `run.output_dir` (NFS, a mounted bucket), or a DVC remote both push to
and pull from (README "Scale out").

Locally, a process pool (the worker runs stages as subprocesses of itself):

    prefect work-pool create gpu --type process
    python -m flows.stage_pool deploy --pool gpu        # registers align-stage/gpu from this checkout
    prefect worker start --pool gpu                     # on the GPU machine, in this checkout
    align run --set run.launch.work_pool=gpu

For a cluster, a Kubernetes or Docker pool with an image of this repository:

    prefect work-pool create gpu --type kubernetes      # or: --type docker
    python -m flows.stage_pool deploy --pool gpu --image registry.example.com/align:latest
    # the pool's base job template requests the GPUs (nvidia.com/gpu: 8) and mounts run.output_dir
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from stages.params_loader import load_params
from stages.launch import training_stages
from tasks.pool import FLOW_NAME
from tasks.stage import STAGE_TASKS

ROOT = Path(__file__).resolve().parent.parent


@flow(name=FLOW_NAME)
def stage_flow(stage: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run one training stage with the resolved `params` (a dict of params.yaml); return its manifest."""
    if stage not in training_stages():
        raise ValueError(f"stage = {stage!r}: the work pool runs training stages only: {', '.join(training_stages())}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        resolved = load_params(path, ["run.launch.work_pool=null"])  # here, not sent on again
    return STAGE_TASKS[stage](resolved)


def deploy(pool: str, image: str | None = None) -> Any:
    """Register `align-stage/<pool>`: from this checkout (process pool) or an image (Docker / Kubernetes)."""
    if image:
        return stage_flow.deploy(name=pool, work_pool_name=pool, image=image, build=False, push=False)
    source = stage_flow.from_source(source=str(ROOT), entrypoint="flows/stage_pool.py:stage_flow")
    return source.deploy(name=pool, work_pool_name=pool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.stage_pool", description="register align-stage/<pool>")
    p.add_argument("command", choices=["deploy"])
    p.add_argument("--pool", required=True, help="the Prefect work pool (prefect work-pool create NAME --type ...)")
    p.add_argument("--image", help="container image of this repository (Docker / Kubernetes pools)")
    args = p.parse_args(argv)
    deploy(args.pool, args.image)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
