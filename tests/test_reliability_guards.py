"""Numeric guards: a NaN/Inf loss stops the stage naming the step and the metric; the last good checkpoint is
kept, never replaced by a NaN one; partial checkpoints of a killed save are never resumed from."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.harness import runner
from stages.harness.config import Params
from stages.harness.params_loader import load_params
from stages.pipeline import training
from tests.conftest import write_params


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards")
    params = load_params(write_params(folder))
    runner.run_stage("preprocess", params)
    return Path(params.run.output_dir)


def poison_loss_from(monkeypatch, step: int):
    """Make SFT's loss NaN from optimizer step `step` (1-based) on."""
    from stages.trainers.sft_trainer import SFTTrainer

    real = SFTTrainer.compute_loss

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        out = real(self, model, inputs, return_outputs=return_outputs, **kw)
        if self.state.global_step + 1 >= step:
            out = (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
        return out

    monkeypatch.setattr(SFTTrainer, "compute_loss", compute_loss)


# save every 3 steps, log every 4: a NaN from step 8 is seen in the log at step 8 (before the save at 9);
# a NaN from step 9 would reach the checkpoint of step 9 before the log at 12: the weight check stops it.
@pytest.mark.parametrize("nan_from, message, last_good", [
    (8, r"sft: non-finite loss = nan, grad_norm = nan at step 8", 6),
    (9, r"sft: non-finite weights in \S+ after step 9; the checkpoint of this step was not saved", 6),
])
def test_nan_loss_stops_the_stage_and_keeps_the_last_good_checkpoint(tmp_path, preprocessed, monkeypatch, caplog,
                                                                     nan_from, message, last_good):
    params = load_params(write_params(tmp_path, {"sft": {"max_steps": 12, "save_steps": 3, "logging_steps": 4,
                                                         "per_device_train_batch_size": 4, "report_to": []}}))
    shutil.copytree(preprocessed, params.run.output_dir)
    poison_loss_from(monkeypatch, nan_from)
    with pytest.raises(runner.StageFailed, match=message) as e:
        runner.run_stage("sft", params)
    assert "last good checkpoint" in str(e.value) or "last good one" in str(e.value)
    assert not runner.output_dir(params, "sft").exists()  # nothing published
    (work,) = Path(params.run.output_dir, ".work").glob("sft-*")
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (work / "checkpoints").glob("checkpoint-*"))
    assert checkpoints[-1] == last_good  # no checkpoint at or after the NaN
    ctx = SimpleNamespace(work=work, log=logging.getLogger("test"))
    assert training.last_checkpoint(ctx).endswith(f"checkpoint-{last_good}")
    from safetensors.torch import load_file

    weights = load_file(work / "checkpoints" / f"checkpoint-{last_good}" / "model.safetensors")
    assert all(w.isfinite().all() for w in weights.values())


def test_nan_exit_code_and_message_from_the_cli(tmp_path, preprocessed, monkeypatch, capsys):
    from stages.__main__ import main

    params = write_params(tmp_path, {"sft": {"max_steps": 6, "save_steps": 3, "logging_steps": 1, "report_to": []}})
    shutil.copytree(preprocessed, tmp_path / "artifacts")
    poison_loss_from(monkeypatch, 2)
    assert main(["sft", "--params", str(params)]) == 5
    assert "error: sft: non-finite loss = nan, grad_norm = nan at step 2" in capsys.readouterr().err


def test_every_training_stage_gets_the_guard():
    from stages.trainers.callbacks import NumericGuard

    ctx = SimpleNamespace(log=logging.getLogger("test"), work=Path("/nonexistent"), stage="sft", params=Params())
    assert any(isinstance(c, NumericGuard) for c in training.callbacks(ctx, [])[1])
    for module in ("sft", "reward", "policy"):  # every training stage builds its callbacks there
        source = Path(training.__file__).with_name(f"{module}.py").read_text()
        assert "training.callbacks(ctx" in source, module


def test_guard_flags_inf_grad_norm_and_eval_loss():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from stages.trainers.callbacks import NonFiniteError, NumericGuard

    args, state = TrainingArguments(output_dir="/tmp/unused", logging_steps=5), TrainerState(global_step=5)
    guard = NumericGuard()
    guard.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "grad_norm": 2.0, "learning_rate": 1e-3})
    with pytest.raises(NonFiniteError, match=r"grad_norm = inf at step 5"):
        guard.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "grad_norm": float("inf")})
    with pytest.raises(NonFiniteError, match=r"eval_loss = nan at step 5"):
        guard.on_log(args, state, TrainerControl(), logs={"eval_loss": float("nan")})


def _checkpoint(folder: Path, step: int, *, complete: bool) -> None:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        for name in ("optimizer.pt", "scheduler.pt"):
            (path / name).write_bytes(b"x")
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    else:
        (path / "trainer_state.json").write_text('{"global_st')  # killed mid-write


def test_partial_checkpoint_of_a_killed_save_is_skipped_and_removed(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    _checkpoint(ckpts, 10, complete=True)
    _checkpoint(ckpts, 20, complete=False)
    ctx = SimpleNamespace(work=tmp_path, log=logging.getLogger("test"))
    with caplog.at_level(logging.WARNING):
        assert training.last_checkpoint(ctx) == str(ckpts / "checkpoint-10")
    assert not (ckpts / "checkpoint-20").exists()
    assert "checkpoint-20: incomplete" in caplog.text
