"""On-policy distillation moves a skill: a weaker student distilled from a stronger teacher of the same tokenizer.

    OMP_NUM_THREADS=1 python -m benchmarks distillation                  # seeds 0 1 2 (about 10 minutes, 1 core)
    python -m benchmarks distillation --seeds 0 --distill-steps 40
    python -m benchmarks distillation --tiny                             # a smoke run (seconds)

Per seed (`run.seed`), through our Python API, in one process:

- data: our `preprocess` stage on the built-in arithmetic task (params.yaml, `--set` overrides), which also builds
  `builtin:tiny`;
- student: our `SFTTrainer` on preprocess's demonstrations (params.yaml's `sft` settings), saved at step
  `--sft-steps` of a `--teacher-sft-steps` run: it has the format and some of the sums;
- teacher: that SFT run to its end, then our `GRPOTrainer` with an exact-match reward (params.yaml's
  `policy.grpo`, `--grpo-steps` steps): better at the same skill, with the same tokenizer;
- distilled: the student trained with our `DistillationTrainer` (reverse KL, beta 1) towards the teacher on the
  prompts of preprocess (`--distill-steps` steps of `--distill-batch` prompts, one sampled completion each,
  learning rate `--distill-lr`, params.yaml's `policy.grpo` sampling temperature and completion length).
  No reward: the teacher's next-token distributions over the student's own samples are the only signal.

Held-out accuracy of all three on the built-in eval prompts (greedy, exact match), decoded and scored as our evaluate
stage does (`benchmarks.efficacy.accuracy`). Prints one line per seed and a table of means ± standard deviations,
with the share of the student-teacher gap the distillation closed: (distilled - student) / (teacher - student).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
from benchmarks.common import host_load, mean_sd, tiny_overrides  # noqa: E402

DEFAULT_SEEDS = (0, 1, 2)


def distill(p, student: str, teacher: str, prompts: list[dict], work: Path, *, steps: int, batch: int, lr: float):
    """Our DistillationTrainer from the student's folder towards the teacher's: the trainer after train()."""
    from stages.trainers import DistillationConfig, DistillationTrainer
    from stages.trainers.inputs import model_name

    g = p.policy.grpo
    cfg = DistillationConfig(output_dir=str(work), max_steps=steps, per_device_train_batch_size=batch,
                             learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=0.05, logging_steps=10,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=p.run.seed,
                             bf16=False, beta=1.0, temperature=g.temperature,
                             max_completion_length=g.max_completion_length, teacher_model_name_or_path=teacher)
    assert model_name(student)
    trainer = DistillationTrainer(student, args=cfg, train_dataset=prompts)
    trainer.train()
    return trainer


def sft_with_student(p, base: str, data: Path, work: Path, steps: int, student_step: int, student: Path):
    """Our SFTTrainer for `steps` steps (params.yaml's `sft`), the model saved to `student` at `student_step` on the
    way: one run gives both the student and the teacher's starting point. The trainer after train()."""
    from transformers import TrainerCallback

    from benchmarks import efficacy
    from stages.trainers import SFTTrainer

    model, tok = efficacy.load(base, p)

    class SaveStudent(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == student_step:
                model.save_pretrained(str(student))
                tok.save_pretrained(str(student))

    cfg = efficacy.our_config(p, p.sft, work, "sft", "fp32", steps)
    trainer = SFTTrainer(model, cfg, processing_class=tok, train_dataset=efficacy.rows_of(data, "sft_train"),
                         callbacks=[SaveStudent()])
    trainer.train()
    return trainer


def run_seed(seed: int, out: Path, overrides: dict, a) -> dict:
    """Student, teacher and distilled student of one seed, and their held-out accuracies. Models already in `out`
    (an earlier run with the same --output-dir) are reused."""
    import torch

    from benchmarks import efficacy
    from stages.harness import runner
    from stages.harness.model_paths import resolve_model

    p = efficacy.seed_params(out, seed, overrides)
    wall, cpu = time.perf_counter(), time.process_time()
    if not (out / "preprocess" / "prompts.jsonl").exists():
        runner.run_stage("preprocess", p)
    data, base = out / "preprocess", resolve_model(p.model, p.run.output_dir)
    eval_rows = efficacy.rows_of(data, "eval")[: a.eval_samples if a.eval_samples > 0 else None]
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in efficacy.rows_of(data, "prompts")]
    student, teacher_sft, teacher = out / "student", out / "teacher-sft", out / "teacher"

    if not (teacher_sft / "config.json").exists():
        torch.manual_seed(seed)
        trainer = sft_with_student(p, base, data, out / "work-sft", a.teacher_sft_steps, a.sft_steps, student)
        trainer.save_model(str(teacher_sft))
        trainer.processing_class.save_pretrained(str(teacher_sft))
        del trainer
    if not (teacher / "config.json").exists():
        torch.manual_seed(seed)
        trainer, tok, _, _ = efficacy.grpo("ours", p, str(teacher_sft), data, out / "work-grpo", "fp32",
                                           a.grpo_steps)
        trainer.save_model(str(teacher))
        tok.save_pretrained(str(teacher))
        del trainer

    torch.manual_seed(seed)
    trainer = distill(p, str(student), str(teacher), prompts, out / "work-distill", steps=a.distill_steps,
                      batch=a.distill_batch, lr=a.distill_lr)
    rec: dict = {"seed": seed}
    for name, folder in (("student", student), ("teacher", teacher)):
        model, tok = efficacy.load(str(folder), p)
        rec[name] = efficacy.accuracy(model, tok, eval_rows, p)
    rec["distilled"] = efficacy.accuracy(trainer.model, trainer.processing_class, eval_rows, p)
    divergences = [h["divergence"] for h in trainer.state.log_history if "divergence" in h]
    rec["divergence_first"], rec["divergence_last"] = (divergences[0], divergences[-1]) if divergences else (0, 0)
    rec["wall_s"], rec["cpu_s"], rec["load"] = time.perf_counter() - wall, time.process_time() - cpu, host_load()
    return rec


def gap_closed(r: dict) -> float | None:
    gap = r["teacher"] - r["student"]
    return (r["distilled"] - r["student"]) / gap if gap > 0 else None


def line(r: dict) -> str:
    closed = gap_closed(r)
    return (f"| {r['seed']} | {r['student']:.1%} | {r['teacher']:.1%} | {r['distilled']:.1%} | "
            f"{'n/a' if closed is None else f'{closed:.0%}'} | {r['divergence_first']:.3f} -> "
            f"{r['divergence_last']:.3f} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['load']:.2f} |")


HEADER = ("| seed | student (short SFT) | teacher (SFT + GRPO) | distilled student | gap closed | divergence "
          "first -> last log | wall s | CPU s | load (1 min) |\n|---|---:|---:|---:|---:|---|---:|---:|---:|")


def summary(records: list[dict]) -> str:
    def fmt(key: str) -> str:
        m, s = mean_sd([r[key] for r in records])
        return f"{m:.1%} ± {s:.1%}"

    closed = [c for c in map(gap_closed, records) if c is not None]
    m, s = mean_sd(closed) if closed else (float("nan"), float("nan"))
    return ("| student (short SFT) | teacher (SFT + GRPO) | distilled student | gap closed |\n|---:|---:|---:|---:|\n"
            f"| {fmt('student')} | {fmt('teacher')} | {fmt('distilled')} | {m:.0%} ± {s:.0%} |")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    ap.add_argument("--sft-steps", type=int, default=150, help="the SFT step the student is saved at")
    ap.add_argument("--teacher-sft-steps", type=int, default=360, help="the teacher's SFT optimizer steps")
    ap.add_argument("--grpo-steps", type=int, default=60, help="the teacher's GRPO optimizer steps (from the student)")
    ap.add_argument("--distill-steps", type=int, default=60, help="distillation optimizer steps")
    ap.add_argument("--distill-batch", type=int, default=32, help="prompts per distillation step")
    ap.add_argument("--distill-lr", type=float, default=1e-3, help="distillation learning rate")
    ap.add_argument("--eval-samples", type=int, default=-1, help="first N eval prompts (default: all 300)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="params.yaml override")
    ap.add_argument("--output-dir", default=None, help="default: a temporary folder, removed afterwards; a folder "
                    "of an earlier run: its student and teacher are reused (distillation settings only change)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and data, 1 seed, 2 steps each, 4 eval prompts")
    a = ap.parse_args(argv)
    if a.tiny:
        a.seeds, a.set = a.seeds[:1], tiny_overrides() + a.set
        a.sft_steps = a.teacher_sft_steps = a.grpo_steps = a.distill_steps = 2
        a.distill_batch, a.eval_samples = 4, 4
    return a


def main(argv=None) -> int:
    import torch
    import transformers

    from stages.harness.params_loader import parse_overrides

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    a = parse(argv)
    overrides, problems = parse_overrides(a.set)
    if problems:
        raise SystemExit("\n".join(problems))
    out = Path(a.output_dir) if a.output_dir else Path(tempfile.mkdtemp(prefix="distillation-"))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, 1-min load {host_load():.2f}; student sft "
          f"{a.sft_steps} steps; teacher sft {a.teacher_sft_steps}, grpo {a.grpo_steps}; distillation "
          f"{a.distill_steps} x {a.distill_batch} prompts (lr {a.distill_lr})", flush=True)
    print(HEADER, flush=True)
    records = []
    try:
        for seed in a.seeds:
            records.append(run_seed(seed, out / f"seed-{seed}", overrides, a))
            print(line(records[-1]), flush=True)
    finally:
        if not a.output_dir:
            shutil.rmtree(out, ignore_errors=True)
    print()
    print(summary(records), flush=True)
    return 0
