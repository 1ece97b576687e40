"""Training stages on a Prefect work pool: the `align-stage` flow and its deployments (the `align` flow's
call to them, when `run.launch.work_pool` is set, is tasks/pool.py).

With `run.launch.work_pool = gpu`, the `align` flow's training stages (sft, reward, policy) become flow runs of
the deployment `align-stage/gpu`, which a worker of the pool `gpu` picks up on its own machine; the parent task
waits for it and fails with it (so its retries apply). Inside, the stage runs as usual: in-process, or through
`accelerate launch`. Outputs must be visible to both sides: a shared `run.output_dir`, or a DVC remote both
push to and pull from (README "Scale out").

    prefect work-pool create gpu --type process         # or --type kubernetes|docker on a cluster
    python -m flows.stage_pool deploy --pool gpu        # --image registry/align:tag for kubernetes/docker
    prefect worker start --pool gpu                     # on the GPU machine, in this checkout
    align run --set run.launch.work_pool=gpu
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from stages.harness.launch import training_stages
from stages.harness.params_loader import load_params
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
