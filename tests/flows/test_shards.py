"""The `align` flow with run.parallel_shards = 2: score's and evaluate's shards run as shard tasks (one process
each) through the flow's task runner; the stages then only assemble, and equal the sequential build."""
import shutil

import pytest
import torch

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import STAGE_ORDER, write_params

pytestmark = pytest.mark.slow

FILES = {"score": ("pairs.jsonl", "scores.jsonl", "histogram.json"), "evaluate": ("metrics.json", "predictions.jsonl")}


def spy(monkeypatch, module, name: str, calls: list, describe) -> None:
    real = getattr(module, name)

    def recording(*args, **kwargs):
        calls.append(describe(*args))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)


def test_flow_fans_shards_out_and_equals_the_sequential_build(tmp_path, built_pipeline, prefect_server, monkeypatch):
    import stages.pipeline.evaluate as evaluate
    import stages.pipeline.score as score
    import tasks.shards
    from flows.align import align

    built, _ = built_pipeline
    params_file = write_params(tmp_path)  # the built pipeline's params; only run.output_dir differs
    params = load_params(params_file)
    shutil.copytree(built.run.output_dir, params.run.output_dir)
    for stage in FILES:
        shutil.rmtree(runner.output_dir(params, stage))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # shard processes compute as this one
    shards, in_process = [], []
    spy(monkeypatch, tasks.shards, "run_shard_process", shards, lambda name, _, k, n: (name, k, n))
    spy(monkeypatch, score, "generate", in_process, lambda *_: "score")
    spy(monkeypatch, evaluate, "generate_outputs", in_process, lambda *_: "evaluate")

    def run():
        state = align(params_file=str(params_file), overrides=["run.parallel_shards=2"], return_state=True)
        assert state.is_completed(), state.message
        return {s["stage"]: s["status"] for s in state.result()["stages"]}

    statuses = run()
    # reference, policy and merge stay cached: score's outputs hash is the sequential one
    assert statuses == {s: "executed" if s in FILES else "cached" for s in STAGE_ORDER}
    assert sorted(shards) == [("evaluate", 0, 2), ("evaluate", 1, 2), ("score", 0, 2), ("score", 1, 2)]
    assert in_process == []  # all sampling happened in the shard processes; the stages only assembled
    for stage, files in FILES.items():
        for f in files:
            assert (runner.output_dir(params, stage) / f).read_bytes() == \
                (runner.output_dir(built, stage) / f).read_bytes(), f"{stage}/{f}"
    assert not list((runner.output_dir(params, "score").parent / ".work").glob("*-*"))

    shards.clear()
    assert set(run().values()) == {"cached"} and shards == []  # current stages start no shard tasks
