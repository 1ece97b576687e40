"""What the benchmarks share: the repository root, the skip convention, host conditions, statistics, peak memory,
and the tiny settings every benchmark's `--tiny` mode runs on.

A benchmark is a module `benchmarks/<name>.py` with `main(argv=None) -> int`, run as `python -m benchmarks <name>`
from the repository root. It returns 0 when it measured, `SKIPPED` (77, the status test harnesses read as
"skipped") with one line saying why when this machine cannot run it (no CUDA GPU, TRL not installed), and
accepts `--tiny`: the same code on the smallest settings, in seconds, for the test suite.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import resource
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = 77

# --tiny: the pipeline on a 1-layer, hidden-32 built-in model, a few hundred rows and a few steps per stage, as
# params overrides (dotted keys, YAML values). The gates and score's filters are off: the tiny model is never right.
TINY_PARAMS: dict[str, object] = {
    "model.builtin.hidden_size": 32, "model.builtin.num_layers": 1, "model.builtin.num_heads": 2,
    "model.builtin.intermediate_size": 64,
    "data.builtin.num_train": 400, "data.builtin.num_preference": 50, "data.builtin.num_eval": 20,
    "data.builtin.num_dev": 20,
    "sft.max_steps": 4, "sft.per_device_train_batch_size": 16, "sft.logging_steps": 1,
    "reward.max_steps": 3, "reward.per_device_train_batch_size": 8, "reward.logging_steps": 1,
    "reward.min_accuracy": 0.0,
    "score.num_prompts": 12, "score.n": 3, "score.generation.max_new_tokens": 6,
    "score.reward_functions": ["reward_model"], "score.reward_weights": None, "score.min_score": None,
    **{f"policy.{m}.{k}": v for m in ("dpo", "kto", "online_dpo", "ppo")
       for k, v in (("max_steps", 3), ("per_device_train_batch_size", 8), ("logging_steps", 1))},
    "policy.num_prompts": 16, "policy.grpo.logging_steps": 1,
    "policy.grpo.num_generations": 2, "policy.grpo.max_steps": 3, "policy.grpo.per_device_train_batch_size": 4,
    "evaluate.max_new_tokens": 4,
}


def tiny_overrides() -> list[str]:
    """TINY_PARAMS as `KEY=VALUE` strings, the form `--set` takes."""
    return [f"{k}={json.dumps(v)}" for k, v in TINY_PARAMS.items()]


def skip(name: str, why: str) -> int:
    """Say why a benchmark cannot run here and return SKIPPED."""
    print(f"{name}: skipped: {why}", flush=True)
    return SKIPPED


def has_trl() -> bool:
    """Whether TRL, the peer the comparisons run against (`pip install -e '.[bench]'`), is importable."""
    return importlib.util.find_spec("trl") is not None


def host_load() -> float:
    """The 1-minute load of this machine, printed beside timings (a shared machine inflates them)."""
    return os.getloadavg()[0]


def mean_sd(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def status_mib(key: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


class PeakMemory:
    """Peak extra memory (MiB) since `start()`, by the most reliable method available.

    CPU: VmHWM (the resident high-water mark), reset to the current RSS at `start()` through
    /proc/self/clear_refs; where that is not possible, ru_maxrss (a lifetime peak, valid only when nothing
    before `start()` used more). CUDA: torch.cuda.max_memory_allocated. Run each variant in a fresh process.
    """

    def __init__(self, device: str = "cpu"):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        self.method = "cuda.max_memory_allocated" if self.cuda else "VmHWM"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated() / 2**20
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = status_mib("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**20 - self.base
        if self.method == "VmHWM":
            return status_mib("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.base


def deep_update(base: dict, extra: dict) -> dict:
    """`extra` merged into `base` in place, nested mappings key by key (params overrides as nested dicts)."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_update(base[k], v)
        else:
            base[k] = v
    return base
