"""Efficacy against TRL 1.16: our SFT, DPO and GRPO trainers and TRL's on the built-in task, side by side.

    python -m benchmarks efficacy                                   # sft dpo grpo, seeds 1 2 3, params.yaml settings
    python -m benchmarks efficacy --methods grpo --seeds 1 --grpo-steps 50
    python -m benchmarks efficacy --write efficacy.md               # also the tables as markdown
    python -m benchmarks efficacy --tiny                            # a smoke run (seconds)
    python -m benchmarks efficacy --params configs/smollm2.yaml --methods grpo dpo --seeds 0 1 2   # the real model
    python -m benchmarks efficacy --params configs/smollm2.yaml --methods grpo --seeds 1 --trainer-seed 11

`--params FILE` reads the settings (model, data, every section) from FILE instead of params.yaml, as
`align run --params FILE` does. Where a section has `lora.enabled`, both sides train LoRA adapters with the
same `peft_config` (r, alpha, dropout, target modules from that section); our SFT model is then merged
(`merge_and_unload`) before it is saved as the common start of DPO and GRPO.

Per seed (`run.seed`), in one process, each side timed alone (never two trainings at once):

- data: our `preprocess` stage (`stages.harness.runner.run_stage`, params.yaml + `--set` overrides) in a temporary
  `run.output_dir`, which also builds `builtin:tiny` (the same base weights for every seed and both sides);
- SFT: params.yaml's `sft` settings on both sides, from the same base weights, on the same
  prompt/completion rows (chat messages, rendered by the model's chat template on both sides),
  completion-only loss, no packing, fp32 (`bf16=False`, `gradient_checkpointing=False` on both);
- DPO: both sides from OUR SFT model of that seed, on the same pairs (preprocess's preference pairs,
  `preference.jsonl`, the `policy.data: preprocess` source), params.yaml's `policy` + `policy.dpo`
  settings (`--dpo-pairs score`: instead the pairs of the pipeline's own `sft` -> `reward` -> `score` stages
  of the seed, from that `sft` stage's model, rows labelled `dpo-score`), reference log-probs precomputed
  once before training on both sides (ours:
  `precompute_ref_log_probs: true`, params.yaml's default; TRL: `precompute_ref_log_probs=True`);
- GRPO: both sides from our SFT model, the prompts of preprocess's `prompts.jsonl`, one reward function
  (`final_number_reward` below, the same Python function on both sides), params.yaml's `policy.grpo`
  settings passed by TRL's names (`max_completion_length`,
  `per_device_train_batch_size` counts completions on both sides).

Held-out accuracy: the eval prompts of the built-in task (`eval.jsonl`, 300), decoded by OUR generator
(`stages.generation.generate`, greedy, `evaluate.max_new_tokens`) for both sides' models and scored by our
evaluate stage's own `row_metrics` (answer regex `evaluate.answer_regex`, exact match): decoding and scoring
are identical. Wall and CPU seconds cover building the trainer (tokenisation, reference pass) + `train()`;
CPU seconds are `time.process_time()` (this process, all threads). The 1-minute load is printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
from benchmarks.common import ROOT, has_trl, host_load, mean_sd, skip, tiny_overrides  # noqa: E402

METHODS = ("sft", "dpo", "grpo")
ROW_METHODS = ("sft", "dpo", "dpo-score", "grpo")  # dpo-score: DPO on the pairs of our score stage
SIDES = ("ours", "trl")
DEFAULT_SEEDS = (1, 2, 3)


# --------------------------------------------------------------------------- shared pieces


def final_number_reward(tokenizer):
    r"""The one reward function of both sides: 1.0 where the completion's final number (after its reasoning
    block) equals the row's `answer`, else 0.0.

    It reads the generated token ids (`completion_ids`, which both trainers pass to reward functions) and
    decodes them itself with our `stages.completion_text.decode_and_strip_padding` (the text our GRPO gives its reward
    functions), so both sides score the same text. The decoded strings each trainer passes as `completions`
    differ: TRL decodes with `skip_special_tokens=True`, which drops this tokenizer's `<think>`/`</think>`
    special tokens and glues the column sums to the answer ("...4+6+1=11</think>114" -> "...=11114"), so a
    final-number reward on TRL's `completions` scores almost every answer wrong. Then evaluate's answer regex
    `(-?\d+)\s*$` takes the final number."""
    from stages.completion_text import decode_and_strip_padding
    from stages.reward_functions import final_integer

    def final_number_reward(prompts, completions, completion_ids=None, answer=None, **_):
        texts = [decode_and_strip_padding([list(ids)], tokenizer)[0] for ids in completion_ids]
        out = []
        for i, text in enumerate(texts):
            got = final_integer(text.strip())
            out.append(float(got is not None and got == int(answer[i])))
        return out

    return final_number_reward


class Clock:
    """Wall (perf_counter) and CPU (process_time) seconds of a block."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def our_config(p, section, work: Path, name: str, precision: str, steps: int | None = None):
    """Our stage's trainer config (stages.pipeline.training.trainer_config): no checkpoints (timing), and the
    precision of this run set explicitly."""
    from stages.pipeline import training

    extra = dict(save_strategy="no", bf16=precision == "bf16", fp16=False, logging_steps=max(section.logging_steps, 1))
    if steps is not None:
        extra["max_steps"] = steps
    return training.trainer_config(SimpleNamespace(work=work, params=p), section, device="cpu", section=name, **extra)


# The TrainingArguments keywords both sides get, read from our stage's config.
SHARED = ("output_dir", "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
          "per_device_eval_batch_size", "gradient_accumulation_steps", "warmup_steps", "lr_scheduler_type",
          "weight_decay", "max_grad_norm", "logging_steps", "logging_nan_inf_filter", "save_strategy", "seed",
          "data_seed", "use_cpu", "bf16", "fp16", "gradient_checkpointing", "disable_tqdm", "report_to")


def common_args(p, section, work: Path, name: str, precision: str, steps: int | None = None) -> dict[str, Any]:
    """The TrainingArguments keywords of our stage `name`, given to both sides."""
    cfg = our_config(p, section, work, name, precision, steps)
    return {k: getattr(cfg, k) for k in SHARED}


def peft_config(section):
    """The LoraConfig both sides get (TRL's `peft_config=` argument), from the section's `lora`, or None."""
    lora = section.lora
    if not lora.enabled:
        return None
    from peft import LoraConfig

    targets = lora.target_modules
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                      target_modules="all-linear" if targets == ["all-linear"] else list(targets))


def loss_types(section) -> list[str]:
    return list(section.loss_type) if isinstance(section.loss_type, (list, tuple)) else [section.loss_type]


def load(path: str, p):
    from stages.models import load_causal_lm, load_tokenizer

    return load_causal_lm(path, dtype=p.model.dtype, device="cpu"), load_tokenizer(path)


def accuracy(model, tokenizer, rows: list[dict], p) -> float:
    """Held-out accuracy exactly as our evaluate stage computes it (its sampling params, generator, metrics)."""
    from stages.pipeline import evaluate

    e = p.evaluate
    model.eval()
    out = evaluate.generate_outputs(model, tokenizer, rows, evaluate.sampling_params(e, p.run.seed),
                                    batch_size=e.batch_size)
    row, _ = evaluate.row_metrics(rows, out, ["accuracy"], re.compile(e.answer_regex), None, None)
    return row["accuracy"]


def rows_of(data: Path, name: str) -> list[dict]:
    from stages.data import read_jsonl

    return read_jsonl(data / f"{name}.jsonl")


# --------------------------------------------------------------------------- SFT


def sft(side: str, p, base: str, data: Path, work: Path, precision: str, steps: int | None):
    model, tok = load(base, p)
    rows = rows_of(data, "sft_train")
    s = p.sft
    args = common_args(p, s, work, "sft", precision, steps)
    with Clock() as clock:
        if side == "ours":
            from stages.trainers.sft_trainer import SFTTrainer

            cfg = our_config(p, s, work, "sft", precision, steps)
            trainer = SFTTrainer(model, cfg, processing_class=tok, train_dataset=rows, peft_config=peft_config(s))
        else:
            import datasets
            import trl

            cfg = trl.SFTConfig(**args, max_length=s.max_length, completion_only_loss=s.completion_only_loss,
                                packing=False, padding_free=False, dataset_num_proc=None)
            trainer = trl.SFTTrainer(model=model, args=cfg, processing_class=tok, peft_config=peft_config(s),
                                     train_dataset=datasets.Dataset.from_list(rows))
        result = trainer.train()
    return trainer, tok, clock, result


# --------------------------------------------------------------------------- DPO


def dpo(side: str, p, start: str, data: Path, work: Path, precision: str, steps: int | None):
    model, tok = load(start, p)
    source = data / "pairs.jsonl" if (data / "pairs.jsonl").exists() else data / "preference.jsonl"
    pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows_of(source.parent, source.stem)]
    d = p.policy.dpo
    args = common_args(p, d, work, "policy.dpo", precision, steps)
    with Clock() as clock:
        if side == "ours":
            from stages.trainers.dpo_trainer import DPOTrainer

            cfg = our_config(p, d, work, "policy.dpo", precision, steps)
            assert cfg.precompute_ref_log_probs, "both sides precompute the reference log-probs"
            trainer = DPOTrainer(model, args=cfg, processing_class=tok, train_dataset=pairs, peft_config=peft_config(d))
        else:
            import datasets
            import trl

            cfg = trl.DPOConfig(**args, beta=d.beta, loss_type=loss_types(d), loss_weights=d.loss_weights,
                                label_smoothing=d.label_smoothing,
                                max_length=d.max_length, precompute_ref_log_probs=True,
                                precompute_ref_batch_size=args["per_device_eval_batch_size"], dataset_num_proc=None)
            trainer = trl.DPOTrainer(model=model, args=cfg, processing_class=tok, peft_config=peft_config(d),
                                     train_dataset=datasets.Dataset.from_list(pairs))
        result = trainer.train()
    return trainer, tok, clock, result


# --------------------------------------------------------------------------- GRPO


def grpo(side: str, p, start: str, data: Path, work: Path, precision: str, steps: int | None):
    model, tok = load(start, p)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows_of(data, "prompts")]
    g = p.policy.grpo
    args = common_args(p, g, work, "policy.grpo", precision, steps)
    with Clock() as clock:
        if side == "ours":
            from stages.trainers.grpo_trainer import GRPOTrainer

            cfg = our_config(p, g, work, "policy.grpo", precision, steps)
            trainer = GRPOTrainer(model, [final_number_reward(tok)], args=cfg, processing_class=tok,
                                  train_dataset=prompts, peft_config=peft_config(g))
        else:
            import datasets
            import trl

            cfg = trl.GRPOConfig(**args, num_generations=g.num_generations,
                                 max_completion_length=g.max_completion_length, temperature=g.temperature,
                                 top_p=g.top_p, top_k=g.top_k, beta=g.beta,
                                 epsilon=g.epsilon, epsilon_high=g.epsilon_high, loss_type=g.loss_type,
                                 scale_rewards=g.scale_rewards, num_iterations=g.num_iterations,
                                 mask_truncated_completions=g.mask_truncated_completions, use_vllm=False,
                                 log_completions=False)
            assert cfg.generation_batch_size == cfg.per_device_train_batch_size  # one generation per step, as ours
            trainer = trl.GRPOTrainer(model=model, reward_funcs=[final_number_reward(tok)], args=cfg,
                                      processing_class=tok, train_dataset=datasets.Dataset.from_list(prompts),
                                      peft_config=peft_config(g))
        result = trainer.train()
    return trainer, tok, clock, result


RUNNERS = {"sft": sft, "dpo": dpo, "grpo": grpo}


# --------------------------------------------------------------------------- the benchmark


def seed_params(out: Path, seed: int, overrides: dict[str, Any], params_file: Path | None = None):
    from stages.harness.params_loader import load_params

    return load_params(params_file or ROOT / "params.yaml", {**overrides, "run.output_dir": str(out),
                                                             "run.seed": seed})


def run_seed(seed: int, methods: list[str], out: Path, overrides: dict[str, Any], steps: dict[str, int | None],
             eval_samples: int, precision: str, report, dpo_pairs: str = "preprocess",
             params_file: Path | None = None, sides: tuple[str, ...] = SIDES,
             trainer_seed: int | None = None) -> list[dict[str, Any]]:
    import torch

    from stages.harness import runner
    from stages.harness.model_paths import resolve_model

    p = seed_params(out, seed, overrides, params_file)
    # --trainer-seed: DPO's and GRPO's own seed (sampling, shuffling, torch) on both sides; data and SFT keep `seed`
    p_policy = p if trainer_seed is None else seed_params(out, trainer_seed, overrides, params_file)
    runner.run_stage("preprocess", p)
    data, base = out / "preprocess", resolve_model(p.model, p.run.output_dir)
    eval_rows = rows_of(data, "eval")[: eval_samples if eval_samples > 0 else None]
    records = []
    sft_model = out / "sft-ours-model"  # our SFT model of this seed: where DPO and GRPO start on both sides
    dpo_start, dpo_data = str(sft_model), data
    if "dpo" in methods and dpo_pairs == "score":  # the pipeline's own sft -> reward -> score of this seed
        for stage in ("sft", "reward", "score"):
            runner.run_stage(stage, p)
        dpo_start, dpo_data = str(out / "sft" / "model"), out / "score"
    need_sft = "sft" in methods or ("grpo" in methods or dpo_start == str(sft_model)) and not sft_model.is_dir()
    for method in ["sft"] * need_sft + [m for m in methods if m != "sft"]:
        for side in SIDES:
            if method != "sft" and side not in sides or method == "sft" and side == "trl" and (
                    "sft" not in methods or side not in sides):
                continue
            pm = p if method == "sft" else p_policy
            torch.manual_seed(pm.run.seed)
            work = out / f"work-{method}-{side}"
            start = base if method == "sft" else dpo_start if method == "dpo" else str(sft_model)
            trainer, tok, clock, result = RUNNERS[method](side, pm, start, dpo_data if method == "dpo" else data,
                                                          work, precision, steps[method])
            acc = accuracy(trainer.model, tok, eval_rows, p)
            if method == "sft" and side == "ours":
                model = trainer.model
                model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
                model.save_pretrained(str(sft_model))
                tok.save_pretrained(str(sft_model))
            rec = {"method": method + ("-score" if method == "dpo" and dpo_pairs == "score" else ""),
                   "side": side, "seed": seed, "accuracy": acc, "wall_s": clock.wall,
                   "cpu_s": clock.cpu, "steps": trainer.state.global_step, "train_loss": result.training_loss,
                   "load": host_load(), "precision": precision, "trainer_seed": pm.run.seed}
            if method in methods:
                records.append(rec)
                report(rec)
            shutil.rmtree(work, ignore_errors=True)
            del trainer
    return records


HEADER = "| method | side | seed | held-out accuracy | wall s | CPU s | steps | train loss | load (1 min) |"


def record_line(r: dict[str, Any]) -> str:
    return (f"| {r['method']} | {r['side']} | {r['seed']} | {100 * r['accuracy']:.1f}% | {r['wall_s']:.1f} | "
            f"{r['cpu_s']:.1f} | {r['steps']} | {r['train_loss']:.4f} | {r['load']:.2f} |")


def summary_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = ["| method | side | seeds | held-out accuracy (mean ± sd) | wall s (mean ± sd) | CPU s (mean ± sd) |",
             "|---|---|---:|---:|---:|---:|"]
    for method in ROW_METHODS:
        for side in SIDES:
            rs = [r for r in records if r["method"] == method and r["side"] == side]
            if not rs:
                continue
            a, w, c = (mean_sd([r[k] for r in rs]) for k in ("accuracy", "wall_s", "cpu_s"))
            lines.append(f"| {method} | {side} | {len(rs)} | {100 * a[0]:.1f}% ± {100 * a[1]:.1f}% | "
                         f"{w[0]:.1f} ± {w[1]:.1f} | {c[0]:.1f} ± {c[1]:.1f} |")
    return lines


def table(records: list[dict[str, Any]]) -> str:
    return "\n".join([HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|", *map(record_line, records), "",
                      *summary_lines(records)])


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    ap.add_argument("--steps-scale", type=float, default=None,
                    help="every method's steps = scale x its default number of optimizer steps")
    for m in METHODS:
        ap.add_argument(f"--{m}-steps", type=int, default=None, help=f"max_steps of {m} on both sides")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                    help="which sides to run (our SFT model of a seed is trained when missing, whichever side)")
    ap.add_argument("--trainer-seed", type=int, default=None,
                    help="DPO's and GRPO's seed on both sides (default: the seed of --seeds); the data and the SFT "
                         "model they start from still follow --seeds")
    ap.add_argument("--eval-samples", type=int, default=-1, help="first N eval prompts (default: all)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: autocast (bf16=True) on both sides, fp32 weights")
    ap.add_argument("--dpo-pairs", choices=("preprocess", "score"), default="preprocess",
                    help="preprocess: preprocess's preference pairs, from our direct SFT model; score: the pipeline's "
                         "sft -> reward -> score stages of the seed (run first), from that sft stage's model")
    ap.add_argument("--params", type=Path, default=None, metavar="FILE",
                    help="the params file (default: params.yaml), e.g. configs/smollm2.yaml for the real model")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="params.yaml override")
    ap.add_argument("--output-dir", default=None, help="default: a temporary folder, removed afterwards")
    ap.add_argument("--write", metavar="FILE", default=None, help="also write the tables to FILE (markdown)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny model and data, 1 seed, 2 steps per method, 4 eval prompts (a smoke run)")
    ap.add_argument("--records", default=None, help="append every record to this JSONL file; --write then "
                    "reports the records already in it too (a run split over several commands)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.seeds = a.seeds[:1]
        a.set = tiny_overrides() + a.set
        a.eval_samples = a.eval_samples if a.eval_samples > 0 else 4
        for m in METHODS:
            setattr(a, f"{m}_steps", getattr(a, f"{m}_steps") or 2)
    return a


def default_steps(p, method: str, data: Path | None = None) -> int:
    """Optimizer steps of `method` at params.yaml's settings (for --steps-scale)."""
    import math

    if method == "grpo" and p.policy.grpo.max_steps:
        return p.policy.grpo.max_steps
    n = {"sft": p.data.builtin.num_train * 0.95, "dpo": p.data.builtin.num_preference * 0.9}[method]
    s = p.sft if method == "sft" else p.policy.dpo
    batch = s.per_device_train_batch_size
    return math.ceil(n / batch) * s.num_train_epochs


def main(argv=None) -> int:
    if not has_trl():
        return skip("efficacy", "TRL is not installed (pip install -e '.[bench]')")
    run(argv)
    return 0


def run(argv=None) -> list[dict[str, Any]]:
    """Every method and seed on both sides; the records, one per method, side and seed."""
    import torch
    import transformers
    import trl

    from stages.harness.params_loader import parse_overrides

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    a = parse(argv)
    overrides, problems = parse_overrides(a.set)
    if problems:
        raise SystemExit("\n".join(problems))
    steps = {m: getattr(a, f"{m}_steps") for m in METHODS}
    if a.steps_scale is not None:
        p0 = seed_params(Path(tempfile.gettempdir()), a.seeds[0], overrides, a.params)
        steps = {m: steps[m] or max(1, round(a.steps_scale * default_steps(p0, m))) for m in METHODS}
    out = Path(a.output_dir) if a.output_dir else Path(tempfile.mkdtemp(prefix="efficacy-"))
    cmd = "python -m benchmarks efficacy " + " ".join(argv if argv is not None else sys.argv[2:])
    print(f"trl {trl.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"1-min load {host_load():.2f}", flush=True)
    print(HEADER, flush=True)
    records: list[dict[str, Any]] = []

    earlier = [json.loads(line) for line in Path(a.records).read_text().splitlines()] \
        if a.records and Path(a.records).exists() else []

    def report(rec):
        print(record_line(rec), flush=True)
        if a.records:
            with open(a.records, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if a.write:
            write(Path(a.write), earlier + records + [rec], cmd, steps, a)

    try:
        for seed in a.seeds:
            records += run_seed(seed, a.methods, out / f"seed-{seed}", overrides, steps, a.eval_samples,
                                a.precision, report, a.dpo_pairs, a.params, tuple(a.sides), a.trainer_seed)
    finally:
        if not a.output_dir:
            shutil.rmtree(out, ignore_errors=True)
    print()
    print(table(records), flush=True)
    print(f"1-min load at the end {host_load():.2f}", flush=True)
    return records


def write(path: Path, records: list[dict[str, Any]], cmd: str, steps: dict, a) -> None:
    import torch
    import trl

    overridden = {m: s for m, s in steps.items() if s is not None}
    path.write_text("\n".join([
        "# Efficacy against TRL 1.16 (`python -m benchmarks efficacy`)", "",
        f"Command: `{cmd}`  ", f"trl {trl.__version__}, torch {torch.__version__}, 1 thread, "
        f"precision {a.precision}, step overrides {overridden or 'none'}, "
        f"eval prompts {a.eval_samples if a.eval_samples > 0 else 'all (300)'}. "
        "The 1-minute load per row: a shared machine inflates the seconds.", "",
        "## Per seed", "", HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|", *map(record_line, records), "",
        "## Mean ± sd over seeds", "", *summary_lines(records), ""]))

