"""Reproducible by construction: the same params give byte-identical model and data outputs through the
flow and through `python -m stages`, and a rebuild that reproduces its results leaves downstream current."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from stages.harness import artifacts, runner
from stages.harness.params_loader import load_params
from tests.conftest import ROOT, STAGE_ORDER, write_params

pytestmark = pytest.mark.slow


def outputs(params) -> dict[str, dict]:
    """stage -> {"hash": outputs hash, "files": {path: sha256}} of every stage's model and data outputs."""
    return {s: artifacts.read_manifest(runner.output_dir(params, s))["outputs"] for s in STAGE_ORDER}


def test_flow_and_cli_give_identical_outputs_and_a_rebuild_keeps_downstream(tmp_path, prefect_server):
    import torch

    from flows.align import align

    (tmp_path / "flow").mkdir()
    (tmp_path / "cli").mkdir()
    by_flow, by_cli = write_params(tmp_path / "flow"), write_params(tmp_path / "cli")
    # the same torch thread count as this process: reductions are split per thread (README "Reproducibility")
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(ROOT)}

    def cli() -> None:  # a fresh process per stage: another RNG history, another hash seed
        for stage in STAGE_ORDER:
            res = subprocess.run([sys.executable, "-m", "stages", stage, "--params", str(by_cli)], cwd=tmp_path,
                                 env=env, capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, f"python -m stages {stage}: {res.stderr[-3000:]}"

    with ThreadPoolExecutor(1) as pool:  # both at once: on 2 cores the test takes half as long
        by_cli_done = pool.submit(cli)
        state = align(params_file=str(by_flow), return_state=True)
        assert state.is_completed(), state.message
        by_cli_done.result()

    flow_params, cli_params = load_params(by_flow), load_params(by_cli)
    flow_out, cli_out = outputs(flow_params), outputs(cli_params)
    for stage in STAGE_ORDER:
        assert cli_out[stage]["files"] == flow_out[stage]["files"], stage
        assert cli_out[stage]["hash"] == flow_out[stage]["hash"], stage
    assert "model/model.safetensors" in flow_out["reward"]["files"]
    assert not any(artifacts.is_log(f) for o in flow_out.values() for f in o["files"])

    before = artifacts.read_manifest(runner.output_dir(flow_params, "sft"))
    rebuilt = runner.run_stage("sft", flow_params, force=True)
    assert rebuilt["executed"] and rebuilt["outputs"]["hash"] == before["outputs"]["hash"]
    assert rebuilt["logs"]["hash"] != before["logs"]["hash"]  # new wall times: the logs did change
    for stage in STAGE_ORDER[2:]:
        assert runner.inspect(stage, flow_params).current, stage
        assert runner.run_stage(stage, flow_params)["executed"] is False, stage
