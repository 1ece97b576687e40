"""SFT efficiency: packing throughput, LoRA size and memory, activation checkpointing.

Usage::

    python -m benchmarks sft              # full sizes (~2.5-3 min on 2 CPU cores)
    python -m benchmarks sft --tiny       # small models and data, ~30-40 s (a smoke run)
    python -m benchmarks sft --threads 2  # torch threads per process (default 1, see below)

Every model is a `builtin:tiny` Llama (`stages.builtin.tiny.build`) written to a temporary
folder; every training run is `stages.trainers.sft_trainer.SFTTrainer`.

1. Packing. A skewed dataset in the conversational prompt/completion form: 90 % short
   additions (1-2 digits, ~23 tokens) and 10 % long ones (36-42 digits with column-by-
   column reasoning, ~400-490 tokens), so the mean row is ~65 tokens. One epoch over the
   same rows, same model and hyper-parameters, twice:
   - packed: `packing=True` (best-fit decreasing into `max_seq_length=512`, padding-free),
     1 packed row (<= 512 real tokens) per step;
   - padded baseline: `packing=False`, rows / packed rows (rounded; 8 at the full size)
     rows per step, each batch padded to its longest row.
   So both make the same number of optimizer steps with about the same real tokens per
   step. Throughput is real (non-pad) tokens / wall time of `trainer.train()`; quality is
   the loss on 64 held-out rows of the same distribution after training.
2. LoRA. r=8 adapters on q/k/v/o (`stages.trainers.adapters.apply_lora` with
   `stages.harness.config.LoraParams`) vs full fine-tuning of the same model: trainable share of
   the parameters, and peak memory of 3 training steps (AdamW, 2 packed rows, ~900
   tokens, per step).
3. Activation checkpointing. One forward+backward at batch 8 x 512 tokens on an 8-layer
   model, with and without `model.activation_checkpointing_enable(
   activation_checkpointing_kwargs={"use_reentrant": False})`: peak activation memory,
   loss and gradients (must match), and time.

Memory: each measured variant runs in a fresh subprocess (the helper is the one in
benchmarks/kernels.py). The child builds its inputs, resets the kernel's peak-RSS counter
(`echo 5 > /proc/self/clear_refs` resets `VmHWM` to the current RSS), records `VmRSS` as
the baseline and reads `VmHWM` afterwards: "peak extra" is the memory the measured work
needed beyond what existed before it. The children run with `MALLOC_MMAP_THRESHOLD_=65536`
so that glibc returns every freed block of 64 KiB or more to the OS at once: otherwise
memory freed in one training step stays resident, and the peak of a multi-step run
depends on heap fragmentation (without it, a LoRA run's peak rose from 294 to 475 MiB on
its second step with nothing live to explain it, and LoRA vs full came out 475 vs 471
MiB in one run and 440 vs 494 in another). The memory children run concurrently (each
has its own counter), before any timing, so they never disturb it.

Timing: the packing runs and the checkpointing step run in this process, after the memory
children have exited. Torch uses 1 thread per process by default: on a shared 2-core
machine, 2 OpenMP threads next to one busy foreign process made training steps 10-25x
slower (every parallel region waits for the descheduled thread), while 1 thread only
halves the speed. Before timing, the packing runs are preceded by 2 untimed steps of
each mode, and the checkpointing variants by untimed full-size steps (see
`ckpt_time_and_equality`); the checkpointing variants are then timed round-robin
(minimum of 2 rounds) so both see the same background load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.common import ROOT, PeakMemory, host_load, status_mib

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
SIZES = {
    "full": {
        "packing": dict(model=dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
                        train_rows=400, eval_rows=64, seq_length=512),
        "lora": dict(model=dict(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=1376),
                     rows=200, packed_batch=2, steps=3),
        "ckpt": dict(model=dict(hidden_size=256, num_layers=8, num_heads=4, intermediate_size=1024),
                     batch=8, seq_length=512, warmup=2, repeats=2),
    },
    "tiny": {
        "packing": dict(model=dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512),
                        train_rows=160, eval_rows=32, seq_length=512),
        "lora": dict(model=dict(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=688),
                     rows=60, packed_batch=1, steps=2),
        "ckpt": dict(model=dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512),
                     batch=4, seq_length=256, warmup=1, repeats=1),
    },
}
TRAINING = dict(learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=0.1, weight_decay=0.0, seed=0)


# ---------------------------------------------------------------------------- data


def _chat_row(rng: random.Random, digits: int) -> dict:
    from stages.builtin import arithmetic

    lo = 10 ** (digits - 1) if digits > 1 else 0
    a, b = rng.randint(lo, 10**digits - 1), rng.randint(lo, 10**digits - 1)
    value, steps = arithmetic.add(a, b)
    return {"prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "completion": [{"role": "assistant", "content": arithmetic.answer_text(value, steps)}]}


def skewed_rows(n: int, seed: int, long_fraction: float = 0.1) -> list[dict]:
    """Prompt/completion chat rows: mostly 1-2 digit sums (~23 tokens), some 36-42 digit ones (~400-490)."""
    rng = random.Random(seed)
    return [_chat_row(rng, rng.randint(36, 42) if rng.random() < long_fraction else rng.randint(1, 2))
            for _ in range(n)]


# -------------------------------------------------------------------------- memory


# ------------------------------------------------------------------------- helpers


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _sft_args(out: Path, **kw):
    from stages.trainers.sft_trainer import SFTConfig

    return SFTConfig(output_dir=str(out), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0, **{**TRAINING, **kw})


class _CountingCollator:
    """Wraps the trainer's collator to count real (non-pad) tokens and token slots per batch."""

    def __init__(self, collate):
        self.collate, self.real, self.slots, self.batches = collate, 0, 0, 0

    def __call__(self, features):
        batch = self.collate(features)
        ids = batch["input_ids"]
        self.slots += ids.numel()
        self.real += int(batch["attention_mask"].sum()) if "attention_mask" in batch else ids.numel()
        self.batches += 1
        return batch


def _lora_params(r: int, targets: list[str]):
    from stages.harness.config import LoraParams

    return LoraParams(enabled=True, r=r, alpha=2 * r, dropout=0.05, target_modules=targets)


# ------------------------------------------------------------------ 1. packing


def packing_run(path: Path, sizes: dict, packed: bool, batch: int, out: Path) -> dict:
    """One epoch of SFT on the skewed rows, padded or packed, `batch` rows per step; throughput and held-out loss."""
    import torch
    from transformers import PrinterCallback

    from stages.trainers.sft_trainer import SFTTrainer

    model, tok = _load(path)
    torch.manual_seed(0)
    args = _sft_args(out, num_train_epochs=1, max_seq_length=sizes["seq_length"], packing=packed,
                     packing_strategy="bfd", per_device_train_batch_size=batch, per_device_eval_batch_size=8,
                     logging_steps=5)
    train, held_out = skewed_rows(sizes["train_rows"], seed=1), skewed_rows(sizes["eval_rows"], seed=2)
    trainer = SFTTrainer(model, args, processing_class=tok, train_dataset=train, eval_dataset=held_out)
    trainer.remove_callback(PrinterCallback)
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    real, slots, steps = counter.real, counter.slots, trainer.state.global_step
    trainer.data_collator = counter.collate
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(run="packed (bfd, padding-free)" if packed else "padded baseline", rows=len(train), batch=batch,
                packed_rows=len(trainer.train_dataset) if packed else None, steps=steps,
                real_tokens=real, slots=slots, seconds=seconds, tokens_per_s=real / seconds,
                last_loss=losses[-1] if losses else float("nan"),
                eval_loss=trainer.evaluate()["eval_loss"])


def packing_pair(path: Path, sizes: dict, root: Path) -> tuple[dict, dict]:
    """(padded, packed) runs. The padded batch size gives both runs the same number of optimizer steps.

    The packed run goes first (1 packed row of <= seq_length tokens per step); the padded
    run then takes rows / packed rows (rounded) rows per step, so both make about the same
    number of updates with about the same real tokens each, and their losses compare.
    """
    packed = packing_run(path, sizes, True, 1, root / "out-packed")
    padded_batch = max(1, round(packed["rows"] / packed["packed_rows"]))
    return packing_run(path, sizes, False, padded_batch, root / "out-padded"), packed


def warm_up(path: Path, sizes: dict, out: Path) -> None:
    """A few steps of both modes on a handful of rows, so one-off library set-up is paid before timing."""
    from transformers import PrinterCallback

    from stages.trainers.sft_trainer import SFTTrainer

    for packed in (True, False):
        model, tok = _load(path)
        args = _sft_args(out, max_steps=2, max_seq_length=sizes["seq_length"], packing=packed,
                         per_device_train_batch_size=2)
        trainer = SFTTrainer(model, args, processing_class=tok, train_dataset=skewed_rows(16, seed=3))
        trainer.remove_callback(PrinterCallback)
        trainer.train()


# --------------------------------------------------------------------- 2. LoRA


def _child_lora(path: Path, sizes: dict, lora: bool, out: Path) -> dict:
    """Peak memory of a few full or LoRA training steps, in this fresh process."""
    from transformers import PrinterCallback

    from stages.trainers.adapters import apply_lora, trainable_fraction
    from stages.trainers.sft_trainer import SFTTrainer

    model, tok = _load(path)
    if lora:
        model = apply_lora(model, _lora_params(8, LORA_TARGETS))
    trainable, total = trainable_fraction(model)
    args = _sft_args(out, max_steps=sizes["steps"], max_seq_length=512, packing=True,
                     per_device_train_batch_size=sizes["packed_batch"], logging_steps=1)
    trainer = SFTTrainer(model, args, processing_class=tok, train_dataset=skewed_rows(sizes["rows"], seed=1))
    trainer.remove_callback(PrinterCallback)
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    meter = PeakMemory()
    meter.start()
    trainer.train()
    peak = meter.peak()
    return dict(run=f"LoRA r=8 on {'/'.join(t.split('_')[0] for t in LORA_TARGETS)}" if lora else
                "full fine-tuning", trainable=trainable, total=total, peak_extra_mib=peak,
                peak_rss_mib=status_mib("VmHWM") if meter.method == "VmHWM" else float("nan"),
                base_mib=meter.base, steps=trainer.state.global_step, tokens_per_step=counter.real / counter.batches,
                method=meter.method)


def lora_fractions(path: Path) -> list[tuple[str, float]]:
    """Trainable share of other LoRA settings on the same model (no training; for reference)."""
    from stages.trainers.adapters import apply_lora, trainable_fraction

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)  # peft
    rows = []
    for r, targets in ((8, ["all-linear"]), (16, ["all-linear"])):
        model, _ = _load(path)
        trainable, total = trainable_fraction(apply_lora(model, _lora_params(r, targets)))
        rows.append((f"r={r} {targets[0]}", 100 * trainable / total))
    return rows


# ------------------------------------------------- 3. activation checkpointing


def _ckpt_inputs(vocab: int, sizes: dict):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (sizes["batch"], sizes["seq_length"]), generator=gen)


def _ckpt_model(path: Path, checkpointing: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model, ids):
    """One forward (loss) and backward: ids (B, T) -> loss tensor."""
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss


def _child_ckpt(path: Path, sizes: dict, checkpointing: bool) -> dict:
    """Peak extra memory of one forward+backward, with or without checkpointing, in this fresh process.

    A warm-up on a tiny input first initialises the kernels and allocates the parameter
    gradients (zeroed, not freed), so the baseline holds weights, gradients and inputs and
    the measured peak is activations plus temporaries.
    """
    model = _ckpt_model(path, checkpointing)
    ids = _ckpt_inputs(model.config.vocab_size, sizes)
    _step(model, ids[:1, :16])
    model.zero_grad(set_to_none=False)
    meter = PeakMemory()
    meter.start()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    fwd = meter.peak()
    loss.backward()
    return dict(checkpointing=checkpointing, loss=loss.item(), fwd_peak_mib=fwd, peak_extra_mib=meter.peak(),
                base_mib=meter.base, method=meter.method)


def ckpt_time_and_equality(path: Path, sizes: dict) -> dict:
    """Both variants in this process on the same weights and inputs: losses, gradients, round-robin time.

    The first full-size steps are slower without checkpointing for a reason that has
    nothing to do with compute: ~1.3 GB of activations are first-touched (330k page
    faults in the first step, 156k and 52k in the next two, none after), until glibc's
    heap has grown to hold them. A training run pays that once, so the `warmup` rounds
    are not timed.
    """
    import torch

    models = {False: _ckpt_model(path, False), True: _ckpt_model(path, True)}
    ids = _ckpt_inputs(models[False].config.vocab_size, sizes)
    times = {False: [], True: []}
    losses, grads = {}, {}
    for round_ in range(sizes["warmup"] + sizes["repeats"]):
        for ckpt, model in models.items():
            model.zero_grad(set_to_none=True)
            gc.collect()
            start = time.perf_counter()
            losses[ckpt] = _step(model, ids).item()
            if round_ >= sizes["warmup"]:
                times[ckpt].append(time.perf_counter() - start)
            grads[ckpt] = {n: p.grad for n, p in model.named_parameters()}
    grad_diff = max((grads[True][n] - g).abs().max().item() for n, g in grads[False].items())
    grad_scale = max(g.abs().max().item() for g in grads[False].values())
    return dict(loss_plain=losses[False], loss_ckpt=losses[True], loss_diff=abs(losses[True] - losses[False]),
                grad_diff=grad_diff, grad_scale=grad_scale, time_plain=min(times[False]),
                time_ckpt=min(times[True]), threads=torch.get_num_threads())


# --------------------------------------------------------------------- parent


def build_models(root: Path, size_key: str) -> dict[str, Path]:
    from stages.builtin import tiny

    paths = {}
    for name, spec in SIZES[size_key].items():
        paths[name] = tiny.build(root / name, **spec["model"], vocab_size=384, seed=0)
    return paths


def _spawn(child: str, root: Path, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks", "sft", "--child", child, "--workdir", str(root),
           "--threads", str(args.threads)]
    if args.tiny:
        cmd.append("--tiny")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(args),
                            cwd=ROOT)


def _child_env(args) -> dict:
    # A fixed mmap threshold makes glibc return every freed block >= 64 KiB to the OS at
    # once, so resident memory follows live memory (see the module docstring).
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error", "MALLOC_MMAP_THRESHOLD_": "65536"}


def memory_children(root: Path, args) -> dict[str, dict]:
    """All memory measurements, each in its own fresh process, run concurrently."""
    procs = {name: _spawn(name, root, args) for name in ("lora", "full", "ckpt-plain", "ckpt-on")}
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"child {name} failed:\n{stderr}")
        results[name] = json.loads(stdout.strip().splitlines()[-1])
    return results


def run_child(name: str, root: Path, size_key: str) -> dict:
    sizes = SIZES[size_key]
    out = root / f"out-{name}"
    if name in ("lora", "full"):
        return _child_lora(root / "lora", sizes["lora"], name == "lora", out)
    return _child_ckpt(root / "ckpt", sizes["ckpt"], name == "ckpt-on")


def _table(head: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < right_from else "---:" for i in range(len(head))) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _check(label: str, ok: bool, detail: str) -> str:
    return f"- {label}: {detail} -> {'MET' if ok else 'MISSED'}"


def packing_table(padded: dict, packed: dict) -> list[str]:
    head = ["run", "rows", "rows/step", "packed rows", "steps", "real tokens/step", "pad share", "train s",
            "real tokens/s", "last train loss", "eval loss"]
    rows = [[r["run"], str(r["rows"]), "1 packed" if r["packed_rows"] else str(r["batch"]),
             str(r["packed_rows"] or "-"), str(r["steps"]), f"{r['real_tokens'] / r['steps']:.0f}",
             f"{100 * (1 - r['real_tokens'] / r['slots']):.0f}%", f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.0f}",
             f"{r['last_loss']:.3f}", f"{r['eval_loss']:.3f}"] for r in (padded, packed)]
    return ["1. Packing (one epoch, same rows; real = non-pad tokens; eval = held-out loss after training)", "",
            *_table(head, rows)]


def lora_table(full: dict, lora: dict, fractions: list[tuple[str, float]]) -> list[str]:
    head = ["run", "trainable params", "total params", "trainable %", "peak extra MiB", "peak RSS MiB"]
    rows = [[r["run"], f"{r['trainable']:,}", f"{r['total']:,}", f"{100 * r['trainable'] / r['total']:.2f}%",
             f"{r['peak_extra_mib']:.0f}", f"{r['peak_rss_mib']:.0f}"] for r in (full, lora)]
    return [f"2. LoRA vs full fine-tuning ({lora['steps']} AdamW steps, ~{lora['tokens_per_step']:.0f} tokens/step; "
            "peak extra = peak RSS during training minus RSS after loading model and data)", "",
            *_table(head, rows), "",
            "   for reference, trainable share on the same model: "
            + ", ".join(f"{name} {pct:.2f}%" for name, pct in fractions)]


def ckpt_table(plain: dict, on: dict, timing: dict, sizes: dict) -> list[str]:
    head = ["run", "loss (fresh process)", "fwd peak extra MiB", "fwd+bwd peak extra MiB",
            f"step s (min of {sizes['repeats']}, after {sizes['warmup']} untimed)"]
    rows = [[name, f"{r['loss']:.6f}", f"{r['fwd_peak_mib']:.0f}", f"{r['peak_extra_mib']:.0f}", f"{seconds:.2f}"]
            for name, r, seconds in (("no checkpointing", plain, timing["time_plain"]),
                                     ("activation_checkpointing_enable", on, timing["time_ckpt"]))]
    return [f"3. Activation checkpointing (one forward+backward, batch {sizes['batch']} x {sizes['seq_length']} "
            "tokens; peak extra over weights + gradients + inputs)", "", *_table(head, rows), "",
            f"   same process, same weights and inputs: |loss diff| = {timing['loss_diff']:.2e}, "
            f"max |grad diff| = {timing['grad_diff']:.2e} (max |grad| = {timing['grad_scale']:.2e})"]


def targets(padded: dict, packed: dict, mem: dict[str, dict], timing: dict) -> list[str]:
    lora, full, plain, on = mem["lora"], mem["full"], mem["ckpt-plain"], mem["ckpt-on"]
    speedup = packed["tokens_per_s"] / padded["tokens_per_s"]
    eval_gap = abs(packed["eval_loss"] - padded["eval_loss"]) / padded["eval_loss"]
    lora_pct = 100 * lora["trainable"] / lora["total"]
    reduction = 1 - on["peak_extra_mib"] / plain["peak_extra_mib"]
    loss_diff = max(timing["loss_diff"], abs(on["loss"] - plain["loss"]))
    return [
        "Targets:", "",
        _check("packing throughput (real tokens/s) vs padded", speedup >= 1.5, f"{speedup:.2f}x (target >= 1.5x)"),
        _check("packing at equal quality (held-out loss)", eval_gap <= 0.05,
               f"{packed['eval_loss']:.3f} vs {padded['eval_loss']:.3f}, {100 * eval_gap:.1f}% apart (target <= 5%)"),
        _check("LoRA trainable share", lora_pct < 2, f"{lora_pct:.2f}% (target < 2%)"),
        _check("LoRA peak training memory vs full", lora["peak_extra_mib"] < full["peak_extra_mib"],
               f"{lora['peak_extra_mib']:.0f} vs {full['peak_extra_mib']:.0f} MiB extra, "
               f"{lora['peak_rss_mib']:.0f} vs {full['peak_rss_mib']:.0f} MiB peak RSS (target: lower)"),
        _check("checkpointing peak activation memory", reduction > 0,
               f"-{100 * reduction:.0f}% ({on['peak_extra_mib']:.0f} vs {plain['peak_extra_mib']:.0f} MiB)"),
        _check("checkpointing loss unchanged", loss_diff <= 1e-5,
               f"|diff| {loss_diff:.1e}, max |grad diff| {timing['grad_diff']:.1e} (target <= 1e-5)"),
        f"- checkpointing time overhead: {100 * (timing['time_ckpt'] / timing['time_plain'] - 1):+.0f}% "
        f"({timing['time_ckpt']:.2f} vs {timing['time_plain']:.2f} s per step) (info)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small models and data (a smoke run, ~30-40 s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers.utils import logging

    torch.set_num_threads(args.threads)
    logging.disable_progress_bar()
    size_key = "tiny" if args.tiny else "full"
    if args.child:
        print(json.dumps(run_child(args.child, Path(args.workdir), size_key)))
        return 0

    start = time.perf_counter()
    load_before = host_load()
    sizes = SIZES[size_key]
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        root = Path(tmp)
        print("building models ...", file=sys.stderr, flush=True)
        paths = build_models(root, size_key)
        print("memory: LoRA / full / checkpointing, in fresh processes ...", file=sys.stderr, flush=True)
        mem = memory_children(root, args)
        fractions = lora_fractions(paths["lora"])
        print("packing: warm-up, packed, padded ...", file=sys.stderr, flush=True)
        warm_up(paths["packing"], sizes["packing"], root / "out-warmup")
        padded, packed = packing_pair(paths["packing"], sizes["packing"], root)
        print("checkpointing: time and equality ...", file=sys.stderr, flush=True)
        ckpt = ckpt_time_and_equality(paths["ckpt"], sizes["ckpt"])
    model_desc = "; ".join(f"{name}: hidden {s['model']['hidden_size']}, {s['model']['num_layers']} layers"
                           for name, s in sizes.items())
    print(f"device=cpu cpus={os.cpu_count()} torch threads={args.threads} memory method={mem['full']['method']} "
          f"({size_key} sizes, {time.perf_counter() - start:.0f} s, 1-min load {load_before:.1f} -> "
          f"{host_load():.1f})")
    print(f"models ({model_desc})")
    print()
    sections = (packing_table(padded, packed), lora_table(mem["full"], mem["lora"], fractions),
                ckpt_table(mem["ckpt-plain"], mem["ckpt-on"], ckpt, sizes["ckpt"]), targets(padded, packed, mem, ckpt))
    print("\n\n".join("\n".join(section) for section in sections))
    if args.tiny:
        print("\n(tiny sizes: small models and data; the targets are only meaningful without --tiny)")
    return 0
