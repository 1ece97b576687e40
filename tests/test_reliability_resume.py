"""Crash-resume: a stage killed with SIGKILL mid-run is never accepted, and its rerun resumes and finishes
exactly as an uninterrupted run does; score resumes from its last finished shard."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.harness import runner
from stages.harness.params_loader import load_params
from stages.pipeline.training import complete_checkpoint
from tests.conftest import ROOT, write_params

STEPS, SAVE = 60, 10


def kill_after_first_checkpoint(params_file: Path, stage: str) -> tuple[int, str]:
    """Run `python -m stages <stage>` as a process, SIGKILL it as soon as a complete checkpoint exists.
    -> (the step of the checkpoints it left, the log).

    "Complete" is the stage's own rule (`complete_checkpoint`): transformers creates trainer_state.json
    empty and then writes it, so a kill on the file's mere existence can leave no complete checkpoint
    at all, and the rerun rightly starts from step 0."""
    work = params_file.parent / "artifacts" / ".work"
    log = params_file.parent / f"{stage}-killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stages", stage, "--params", str(params_file)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 240
        try:
            while not any(map(complete_checkpoint, work.glob(f"{stage}-*/checkpoints/checkpoint-*"))):
                assert proc.poll() is None, f"{stage} ended before its first checkpoint:\n{log.read_text()}"
                assert time.time() < deadline, "no checkpoint within 240 s"
                time.sleep(0.005)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    steps = [int(p.name.split("-")[1]) for p in work.glob(f"{stage}-*/checkpoints/checkpoint-*")]
    return max(steps), log.read_text()


def logged(folder: Path, key: str = "loss") -> dict[int, float]:
    return {h["step"]: h[key] for h in json.loads((folder / "log_history.json").read_text()) if key in h}


def assert_same_weights(a: Path, b: Path, tolerance: float = 1e-5) -> float:
    """-> the largest absolute difference between the two saved models' weights."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    worst = 0.0
    for k in wa:
        diff = (wa[k].float() - wb[k].float()).abs().max().item()
        assert diff <= tolerance, (k, diff)
        worst = max(worst, diff)
    return worst


def check_killed_then_resumed(tmp_path: Path, stage: str, section: dict, prepare, *, steps: int = STEPS,
                              save: int = SAVE, keys: tuple[str, ...] = ("loss",), tolerance: float = 1e-5) -> dict:
    """Run `stage` uninterrupted, then SIGKILLed after a checkpoint and rerun: the same steps, the same logged
    `keys` at every step and the same weights. -> the figures (resumed_at, largest differences)."""
    for name in ("clean", "killed"):
        (tmp_path / name).mkdir()
    killed_file = write_params(tmp_path / "killed", section)
    clean, killed = load_params(write_params(tmp_path / "clean", section)), load_params(killed_file)
    prepare(clean, killed)
    reference = runner.run_stage(stage, clean)  # uninterrupted
    assert reference["metrics"]["steps"] == steps and reference["metrics"]["resumed_from"] is None

    step, log = kill_after_first_checkpoint(killed_file, stage)
    assert 0 < step < steps, log
    # nothing partial was ever accepted: no output folder, the status says not current
    assert not runner.output_dir(killed, stage).exists()
    row = next(r for r in runner.status(killed) if r["stage"] == stage)
    assert row["current"] is False and row["reason"] == "missing"

    resumed = runner.run_stage(stage, killed)
    m = resumed["metrics"]
    resumed_at = int(m["resumed_from"].rsplit("-", 1)[1])  # the last *complete* checkpoint (one may be partial)
    assert 0 < resumed_at <= step and resumed_at % save == 0
    assert m["steps"] == reference["metrics"]["steps"] == steps
    # the logged trajectory continues exactly where the killed run left it, and ends where the clean run ends
    figures = {"steps": steps, "resumed_at": resumed_at}
    for key in keys:
        a, b = logged(runner.output_dir(clean, stage), key), logged(runner.output_dir(killed, stage), key)
        assert sorted(a) == sorted(b) and (key != "loss" or sorted(a) == list(range(1, steps + 1))), (key, a, b)
        assert all(abs(a[s] - b[s]) <= 1e-5 * max(1.0, abs(a[s])) for s in a), \
            (key, [(s, a[s], b[s]) for s in a if a[s] != b[s]])
        figures[f"max_{key}_diff"] = max(abs(a[s] - b[s]) for s in a)
    figures["max_weight_diff"] = assert_same_weights(runner.output_dir(clean, stage), runner.output_dir(killed, stage),
                                                     tolerance)
    assert runner.inspect(stage, killed).current
    assert not list(Path(killed.run.output_dir, ".work").glob(f"{stage}-*"))  # checkpoints removed on success
    assert runner.run_stage("preprocess", killed)["executed"] is False  # stages before it: cache hits
    return figures


@pytest.mark.slow
def test_sft_killed_mid_run_resumes_to_the_same_result(tmp_path):
    def prepare(clean, killed):
        runner.run_stage("preprocess", clean)
        shutil.copytree(Path(clean.run.output_dir), Path(killed.run.output_dir))

    check_killed_then_resumed(tmp_path, "sft", {"sft": {"max_steps": STEPS, "save_steps": SAVE, "logging_steps": 1,
                                                        "per_device_train_batch_size": 4}}, prepare)


def upstream_of_policy(built_pipeline):
    """`prepare` for a policy run: every stage before `policy` copied from the session's built pipeline
    (`reference` rerun: it depends on policy.method, and records in no time that GRPO/PPO need no pass)."""
    params, _ = built_pipeline

    def prepare(clean, killed):
        for p in (clean, killed):
            shutil.copytree(params.run.output_dir, p.run.output_dir)
            shutil.rmtree(runner.output_dir(p, "policy"))
            shutil.rmtree(runner.output_dir(p, "evaluate"))
            if p.policy.method != params.policy.method:
                runner.run_stage("reference", p)
    return prepare


@pytest.mark.slow
def test_dpo_killed_mid_run_resumes_to_the_same_result(tmp_path, built_pipeline):
    check_killed_then_resumed(tmp_path, "policy", {"policy": {"method": "dpo", "dpo": {
                                  "max_steps": STEPS, "save_steps": SAVE, "logging_steps": 1,
                                  "per_device_train_batch_size": 2}}},
                              upstream_of_policy(built_pipeline))


def assert_trained(tmp_path: Path, reward_key: str) -> None:
    """The comparison was not vacuous: the logged rewards vary and the policy moved away from the SFT model."""
    from safetensors.torch import load_file

    out = tmp_path / "clean" / "artifacts"
    rewards = logged(out / "policy", reward_key)
    assert len(set(rewards.values())) > 1, rewards
    sft, policy = load_file(out / "sft" / "model" / "model.safetensors"), load_file(out / "policy" / "model" /
                                                                                    "model.safetensors")
    assert any(not torch.equal(sft[k], policy[k]) for k in sft)


@pytest.mark.slow
def test_grpo_killed_mid_run_resumes_to_the_same_samples_rewards_and_weights(tmp_path, built_pipeline):
    """Two updates per generation (num_iterations 2) and two micro-batches per step, checkpoints every 3 steps:
    a resume at step 3 (the first checkpoint) falls between the two updates of one generation, so the rerun
    must reuse the buffered samples of the killed run (and their log-probs at sampling time), not draw new ones."""
    section = {"method": "grpo", "grpo": {"save_steps": 3, "logging_steps": 1, "gradient_accumulation_steps": 2,
                                          "max_steps": 8, "num_iterations": 2, "reward_functions": ["reward_model"]}}
    figures = check_killed_then_resumed(tmp_path, "policy", {"policy": section}, upstream_of_policy(built_pipeline),
                                        steps=8, save=3, keys=("loss", "reward"), tolerance=1e-6)
    print(f"\nGRPO resume: {figures}")
    assert_trained(tmp_path, "reward")


@pytest.mark.slow
def test_ppo_killed_mid_run_resumes_to_the_same_samples_rewards_and_weights(tmp_path, built_pipeline):
    """A rollout and its PPO epochs are one Trainer step, so no rollout outlives a checkpoint: the samples follow
    from the step's seed, the minibatch shuffles from the restored RNG state."""
    section = {"method": "ppo", "ppo": {"save_steps": 2, "logging_steps": 1, "max_steps": 6, "num_ppo_epochs": 2,
                                        "num_mini_batches": 2}}
    figures = check_killed_then_resumed(tmp_path, "policy", {"policy": section}, upstream_of_policy(built_pipeline),
                                        steps=6, save=2, keys=("loss", "score"), tolerance=1e-6)
    print(f"\nPPO resume: {figures}")
    assert_trained(tmp_path, "score")


def test_score_resumes_from_its_last_finished_shard(tmp_path, built_pipeline, monkeypatch):
    """12 prompts in shards of 4: a crash while sampling shard 3 keeps shards 1-2; the rerun samples only
    shard 3, and the result equals an uninterrupted run's."""
    import stages.pipeline.score as score

    params, _ = built_pipeline
    shards = {"score": {"generation": {"batch_size": 4}}}
    runs = {}
    for name in ("clean", "crashed"):
        (tmp_path / name).mkdir()
        runs[name] = load_params(write_params(tmp_path / name, shards))
        shutil.copytree(params.run.output_dir, runs[name].run.output_dir)
        shutil.rmtree(runner.output_dir(runs[name], "score"))
    calls = []
    real = score.generate

    def counting(*args, **kwargs):
        calls.append(len(args[2]))
        if crash_on and len(calls) == crash_on:
            raise RuntimeError("killed while sampling")
        return real(*args, **kwargs)

    monkeypatch.setattr(score, "generate", counting)
    crash_on = 0
    clean = runner.run_stage("score", runs["clean"])
    assert calls == [4, 4, 4]

    calls.clear()
    crash_on = 3
    with pytest.raises(RuntimeError, match="killed while sampling"):
        runner.run_stage("score", runs["crashed"])
    assert not runner.output_dir(runs["crashed"], "score").exists()
    work = list(Path(runs["crashed"].run.output_dir, ".work").glob("score-*/shards"))
    assert [p.name for p in sorted(work[0].iterdir())] == ["0000.jsonl", "0001.jsonl"]

    calls.clear()
    crash_on = 0
    m = runner.run_stage("score", runs["crashed"])
    assert calls == [4]  # only the unfinished shard was sampled again
    assert m["metrics"] == clean["metrics"] and m["metrics"]["completions"] == 36
    for f in ("scores.jsonl", "pairs.jsonl"):
        assert (runner.output_dir(runs["crashed"], "score") / f).read_bytes() == \
            (runner.output_dir(runs["clean"], "score") / f).read_bytes()
