"""DistillationTrainer on built-in models: the student moves towards the teacher (the divergence falls), every
student weight changes and no teacher weight does; a teacher equal to the student gives zero loss; a teacher with
another vocabulary is refused by name before training."""
from __future__ import annotations

import copy

import pytest
import torch

from stages.builtin import tiny
from stages.trainers import DistillationConfig, DistillationTrainer
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    student = build_tiny(tmp_path_factory.mktemp("student"), num_heads=4)
    teacher = tiny.build(tmp_path_factory.mktemp("teacher"), hidden_size=48, num_layers=2, num_heads=4,
                         intermediate_size=96, vocab_size=384, seed=1)
    return str(student), str(teacher), builtin_rows("prompts", "prompt_only", num_train=16, num_eval=4)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, max_completion_length=8,
                learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0)
    return DistillationConfig(**{**base, **kw})


def test_student_moves_towards_the_teacher(setup, tmp_path):
    student, teacher, rows = setup
    trainer = DistillationTrainer(student, teacher, args=_args(tmp_path, max_steps=30), train_dataset=rows)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    teacher_before = copy.deepcopy(trainer.teacher_model.state_dict())
    trainer.train()
    assert {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])} == set(before)
    assert all(torch.equal(v, trainer.teacher_model.state_dict()[k]) for k, v in teacher_before.items())
    losses = [h["divergence"] for h in trainer.state.log_history if "divergence" in h]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_teacher_equal_to_the_student_gives_zero_loss(setup, tmp_path):
    student, _, rows = setup
    trainer = DistillationTrainer(student, args=_args(tmp_path, teacher_model_name_or_path=student),
                                  train_dataset=rows)
    batch = trainer.make_batch(rows[:4])
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(0.0, abs=1e-6)


def test_teacher_with_another_vocabulary_is_refused_by_key(setup, tmp_path):
    student, _, rows = setup
    other = tiny.build(tmp_path / "other", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                       vocab_size=320, seed=0)
    with pytest.raises(ValueError, match=r"DistillationConfig\.teacher_model_name_or_path = .*320 tokens, the "
                                         r"student's \d+"):
        DistillationTrainer(student, args=_args(tmp_path, teacher_model_name_or_path=str(other)), train_dataset=rows)


def test_no_teacher_and_bad_beta_are_named(setup, tmp_path):
    student, _, rows = setup
    with pytest.raises(ValueError, match="no teacher"):
        DistillationTrainer(student, args=_args(tmp_path), train_dataset=rows)
    with pytest.raises(ValueError, match=r"beta"):
        _args(tmp_path, beta=1.5)


def _first_step_grads(student, teacher, rows, tmp_path, accumulation: int) -> dict[str, torch.Tensor]:
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    grab = Grab()
    args = _args(tmp_path / str(accumulation), max_steps=1, per_device_train_batch_size=4 // accumulation,
                 gradient_accumulation_steps=accumulation)
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=rows[:4], callbacks=[grab])
    trainer.train()
    return grab.grads


def test_accumulation_gives_the_one_batch_gradient(setup, tmp_path):
    """4 prompts as 1 micro-batch or 2 of 2: the same gradient, because each micro-batch's loss divides by the whole
    step's completion positions (a per-micro-batch mean, not divided again by the accumulation steps, would double
    it; the untrained student fills every completion, so the counts are equal here)."""
    student, teacher, rows = setup
    one = _first_step_grads(student, teacher, rows, tmp_path, 1)
    two = _first_step_grads(student, teacher, rows, tmp_path, 2)
    scale = max(g.abs().max().item() for g in one.values())
    assert scale > 0
    assert all(torch.allclose(two[n], g, atol=1e-5 * scale, rtol=1e-4) for n, g in one.items())


def test_evaluation_is_the_divergence_on_held_out_prompts(setup, tmp_path):
    """eval_dataset, as TRL's: the student samples each held-out prompt (a fixed draw, so two evaluations agree)
    and eval_loss is the mean divergence from the teacher over the completion positions, equal to the loss
    computed directly on that batch; the batch's metrics arrive under eval_; training lowers it."""
    from stages.losses import distillation_loss
    from stages.trainers.distillation_trainer import completion_logits

    student, teacher, rows = setup
    held_out = builtin_rows("prompts", "prompt_only", num_train=16, num_eval=4, num_preference=8)[:3]
    args = _args(tmp_path, max_steps=30, per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=15)
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=rows, eval_dataset=held_out)
    before = trainer.evaluate()
    assert trainer.evaluate()["eval_loss"] == before["eval_loss"]
    batch = trainer.make_batch(held_out, evaluation=True)
    trainer._metrics["eval"].clear()  # make_batch above recorded its lengths as evaluation's
    with torch.no_grad():
        direct, _ = distillation_loss(completion_logits(trainer.model, batch),
                                      completion_logits(trainer.teacher_model, batch), beta=args.beta,
                                      temperature=args.sampling.temperature)
    assert before["eval_loss"] == pytest.approx(direct.item(), rel=1e-5) and before["eval_loss"] > 0
    assert before["eval_completions/mean_length"] == pytest.approx(batch["completion_mask"].sum(1).float().mean())
    assert "eval_divergence" in before
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [15, 30]
    assert trainer.evaluate()["eval_loss"] < before["eval_loss"]
    train_lines = [h for h in trainer.state.log_history if "loss" in h]
    assert train_lines and all(not any(k.startswith("eval_") for k in h) for h in train_lines)


def test_eval_rows_need_prompts(setup, tmp_path):
    student, teacher, rows = setup
    with pytest.raises(ValueError, match=r"eval_dataset: distillation needs rows with a 'prompt' column; 1 of 1 "):
        DistillationTrainer(student, teacher, args=_args(tmp_path), train_dataset=rows,
                            eval_dataset=[{"question": "1+1"}])
