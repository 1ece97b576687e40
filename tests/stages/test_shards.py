"""Shards of `score` and `evaluate` computed apart (`runner.run_shard`, `python -m stages <stage> --shard K
--num-shards N`), then the plain stage run: the same bytes as a sequential run, and the assembly samples nothing."""
import shutil
from pathlib import Path

import pytest

from stages.__main__ import main
from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params


def copy_of(built_pipeline, folder: Path, extra: dict):
    """(params file, params) of a private copy of the built pipeline with `extra` params."""
    built, _ = built_pipeline
    params_file = write_params(folder, extra)
    params = load_params(params_file)
    shutil.copytree(built.run.output_dir, params.run.output_dir)
    return params_file, params


def count_calls(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def outputs(params, stage: str, files: tuple[str, ...]) -> dict[str, bytes]:
    return {f: (runner.output_dir(params, stage) / f).read_bytes() for f in files}


def test_score_shards_then_stage_equal_a_sequential_run(tmp_path, built_pipeline, monkeypatch):
    """12 prompts in prompt shards of 4 (0, 1, 2) as 2 shares: share 0 = shards 0 and 2, share 1 = shard 1."""
    import stages.pipeline.score as score

    params_file, params = copy_of(built_pipeline, tmp_path, {"score": {"generation": {"batch_size": 4}}})
    files = ("pairs.jsonl", "scores.jsonl", "histogram.json")
    calls = count_calls(monkeypatch, score, "generate")
    sequential = runner.run_stage("score", params)
    assert len(calls) == 3
    expected = outputs(params, "score", files)
    shutil.rmtree(runner.output_dir(params, "score"))

    calls.clear()
    share = runner.run_shard("score", params, 0, 2)
    assert (share["executed"], share["shards"], share["sampled"], len(calls)) == (True, [0, 2], 2, 2)
    assert share["fingerprint"] == sequential["fingerprint"]  # the stage's own work folder
    assert not runner.output_dir(params, "score").exists()  # a shard publishes nothing
    assert main(["score", "--params", str(params_file), "--shard", "1", "--num-shards", "2"]) == 0
    assert len(calls) == 3
    work = runner.work_dir(params, "score", sequential["fingerprint"]) / "shards"
    assert sorted(p.name for p in work.iterdir()) == ["0000.jsonl", "0001.jsonl", "0002.jsonl"]
    assert runner.run_shard("score", params, 0, 2)["sampled"] == 0 and len(calls) == 3  # a rerun share reuses

    calls.clear()
    assembled = runner.run_stage("score", params)
    assert calls == []  # every shard was saved: nothing sampled, the SFT model not even loaded
    assert assembled["executed"] and assembled["metrics"] == sequential["metrics"]
    assert outputs(params, "score", files) == expected
    assert assembled["outputs"]["hash"] == sequential["outputs"]["hash"]
    assert not work.parent.exists()  # the work folder goes once the output is sealed
    assert runner.run_shard("score", params, 1, 2)["executed"] is False  # current: nothing to compute


def test_evaluate_shards_then_stage_equal_a_sequential_run(tmp_path, built_pipeline, monkeypatch):
    """4 models as 2 shares: share 0 = base, policy; share 1 = sft, merged."""
    import stages.pipeline.evaluate as evaluate

    _, params = copy_of(built_pipeline, tmp_path, {"evaluate": {"max_new_tokens": 5}})
    files = ("metrics.json", "predictions.jsonl")
    calls = count_calls(monkeypatch, evaluate, "generate_outputs")
    sequential = runner.run_stage("evaluate", params)
    assert len(calls) == 4
    expected = outputs(params, "evaluate", files)
    shutil.rmtree(runner.output_dir(params, "evaluate"))

    calls.clear()
    assert runner.run_shard("evaluate", params, 0, 2)["models"] == ["base", "policy"]
    assert runner.run_shard("evaluate", params, 1, 2)["models"] == ["sft", "merged"]
    assert len(calls) == 4
    calls.clear()
    assembled = runner.run_stage("evaluate", params)
    assert calls == [] and assembled["executed"]
    assert outputs(params, "evaluate", files) == expected
    assert assembled["metrics"]["table"] == sequential["metrics"]["table"]


def test_bad_shard_requests_are_refused(built_pipeline, capsys):
    params, _ = built_pipeline
    with pytest.raises(ValueError, match="stage 'sft' has no shards to compute apart; sharded stages: score"):
        runner.run_shard("sft", params, 0, 2)
    with pytest.raises(ValueError, match="shard 2 of 2: need 0 <= shard < num_shards"):
        runner.run_shard("score", params, 2, 2)
    assert main(["score", "--shard", "0"]) == 2
    assert "--shard K needs --num-shards N" in capsys.readouterr().err
