"""Training stages on a Prefect work pool: the `align-stage` flow, its deployments, and the call the
`align` flow makes when `run.launch.work_pool` is set.

The `align` flow runs where it is started. With `run.launch.work_pool = gpu`, its training
stages (sft, reward, policy) become flow runs of the deployment `align-stage/gpu`, which a
worker of the pool `gpu` picks up on its own machine; the parent task waits for it and fails
with it (so its retries apply). Inside, the stage runs as usual: in-process, or through
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
from prefect import flow, get_run_logger

from stages import artifacts
from stages.config import Params, load_params

ROOT = Path(__file__).resolve().parent.parent
FLOW_NAME = "align-stage"


@flow(name=FLOW_NAME)
def stage_flow(stage: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run one training stage with the resolved `params` (a dict of params.yaml); return its manifest."""
    from tasks.policy import policy
    from tasks.reward import reward
    from tasks.sft import sft

    tasks = {"sft": sft, "reward": reward, "policy": policy}
    if stage not in tasks:
        raise ValueError(f"stage = {stage!r}: the work pool runs training stages only: {', '.join(tasks)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        resolved = load_params(path, ["run.launch.work_pool=null"])  # here, not sent on again
    return tasks[stage](resolved)


def run_on_pool(stage: str, params: Params) -> dict[str, Any]:
    """Run `stage` as a flow run of `align-stage/<run.launch.work_pool>` and wait; its manifest from disk."""
    from prefect.deployments import run_deployment

    pool = params.run.launch.work_pool
    name = f"{FLOW_NAME}/{pool}"
    get_run_logger().info("%s: sent to work pool %r (deployment %s)", stage, pool, name)
    run = run_deployment(name=name, parameters={"stage": stage, "params": params.to_dict()}, timeout=None)
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
