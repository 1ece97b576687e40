"""The orchestration's scale-out engines, run for real (README "Scale out"):

- score's and evaluate's shard tasks on a Dask LocalCluster (2 worker processes, 1 thread each) through
  prefect-dask (`run.dask_address`), byte-identical to the sequential in-process build;
- a training stage sent to a Prefect `process` work pool (`run.launch.work_pool`) and run by a real
  `prefect worker` on the test's Prefect server, with the in-process build's manifest;
- an unreachable `run.dask_address` fails the flow at once, naming key and address, writing nothing.

`pytest -s tests/flows/test_scale_out.py` prints the wall times.
"""
import json
import os
import shutil
import socket
import time

import pytest
import torch

from stages.harness import runner
from stages.harness.params_loader import load_params
from stages.trackers import flat
from tests.conftest import STAGE_ORDER, write_params

pytestmark = pytest.mark.slow

SHARDED = {"score": ("pairs.jsonl", "scores.jsonl", "histogram.json"),
           "evaluate": ("metrics.json", "predictions.jsonl")}


def copy_without(built, folder, stages):
    """The built pipeline's params (only run.output_dir differs) and outputs, less `stages`'."""
    params_file = write_params(folder)
    params = load_params(params_file)
    shutil.copytree(built.run.output_dir, params.run.output_dir)
    for stage in stages:
        shutil.rmtree(runner.output_dir(params, stage))
    return params_file, params


def run_flow(params_file, overrides):
    from flows.align import align

    start = time.perf_counter()
    state = align(params_file=str(params_file), overrides=overrides, return_state=True)
    return state, time.perf_counter() - start


def test_shards_on_a_dask_cluster_equal_the_sequential_build(tmp_path, built_pipeline, prefect_server, monkeypatch):
    from distributed import Client, LocalCluster

    built, manifests = built_pipeline
    params_file, params = copy_without(built, tmp_path, SHARDED)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # shard processes compute as this one
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        state, wall = run_flow(params_file, ["run.parallel_shards=2", f"run.dask_address={cluster.scheduler_address}"])
        assert state.is_completed(), state.message
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)  # {worker address: tasks}
    summary = state.result()["stages"]
    assert {s["stage"]: s["status"] for s in summary} == {s: "executed" if s in SHARDED else "cached"
                                                          for s in STAGE_ORDER}
    # 2 shards of score, then 2 of evaluate, on both single-thread workers
    assert sum(executed.values()) == 4 and min(executed.values()) >= 1, executed
    for stage, files in SHARDED.items():
        for f in files:
            assert (runner.output_dir(params, stage) / f).read_bytes() == \
                (runner.output_dir(built, stage) / f).read_bytes(), f"{stage}/{f}"
    sequential = sum(manifests[s]["wall_time_s"] for s in SHARDED)
    assembled = sum(s["wall_time_s"] for s in summary if s["stage"] in SHARDED)
    print(f"\n[dask] score + evaluate as 2 + 2 shard tasks on LocalCluster(2 workers): flow {wall:.1f} s (stages "
          f"assembling {assembled:.1f} s); sequential in-process stages {sequential:.1f} s; "
          f"{sum(map(len, SHARDED.values()))} output files byte-identical")


@pytest.fixture
def process_worker(tmp_path, prefect_server):
    """A Prefect `process` work pool with the align-stage deployment, and a real `prefect worker` polling it."""
    import subprocess
    import sys
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    from flows.stage_pool import deploy

    pool = f"cpu-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    deploy(pool)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the flow run computes as this process
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield pool
    finally:
        os.killpg(worker.pid, 15)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
            worker.wait()
        log.close()


def test_training_stage_on_a_process_work_pool_has_the_in_process_manifest(tmp_path, built_pipeline, process_worker):
    built, manifests = built_pipeline
    params_file, params = copy_without(built, tmp_path, ["sft"])
    state, wall = run_flow(params_file, [f"run.launch.work_pool={process_worker}"])
    assert state.is_completed(), (state.message, (tmp_path / "worker.log").read_text()[-3000:])
    summary = state.result()["stages"]
    # sft went to the pool and came back with its outputs hash: every stage below it stays current
    assert {s["stage"]: s["status"] for s in summary} == {s: "executed" if s == "sft" else "cached"
                                                          for s in STAGE_ORDER}
    assert pool_runs(process_worker) == ["Completed"]  # sft, run by the worker; current reward and policy not sent
    in_process = flat(manifests["sft"])
    on_pool = flat(json.loads((runner.output_dir(params, "sft") / "manifest.json").read_text()))
    in_process.pop("executed", None)
    differ = {k for k in in_process.keys() | on_pool.keys() if in_process.get(k) != on_pool.get(k)}
    assert on_pool["fingerprint"] == in_process["fingerprint"] and on_pool["outputs.hash"] == in_process["outputs.hash"]
    # what may differ: when and how long it ran, and the logs, which carry wall times, host names and pids
    assert {k for k in differ if not k.startswith(TIMING)} == set(), sorted(differ)
    print(f"\n[pool] sft on a process work pool: flow {wall:.1f} s (the stage {on_pool['wall_time_s']:.1f} s in the "
          f"worker's flow run); in-process {in_process['wall_time_s']:.1f} s; manifest identical but {sorted(differ)}")


def pool_runs(pool: str) -> list[str]:
    """The states of the flow runs of deployment align-stage/<pool>."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"align-stage/{pool}")
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return [r.state.name for r in runs]


# the seal covers the timing
TIMING = ("started_at", "wall_time_s", "metrics.train_runtime_s", "logs.", "manifest_hash")


def test_an_unreachable_dask_address_fails_the_flow_before_any_stage(tmp_path, prefect_server):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    params_file = write_params(tmp_path)
    start = time.perf_counter()
    state, _ = run_flow(params_file, ["run.parallel_shards=2", f"run.dask_address={address}"])
    assert state.is_failed()
    assert f"run.dask_address = '{address}': no Dask scheduler answers there" in state.message, state.message
    assert time.perf_counter() - start < 30  # not prefect-dask's 30 s connect timeout, after training
    assert not (tmp_path / "artifacts").exists() or not any(
        p.name != "logs" for p in (tmp_path / "artifacts").iterdir()), "nothing written"
