"""Seeds and determinism settings, set once before a stage runs; what its outputs still depend on.

`stages.harness.runner` calls `prepare(run)` (threads from `run.threads`, then
`seed_everything(run.seed)`) before every stage entry point (and every
shard, and every launched rank), whichever way it was started (the Prefect flow, `python -m
stages`, `dvc repro`). So whatever a stage draws before its trainer sets its own seed — a fresh
reward-model `score` head, a PPO value head, LoRA's `A` matrices, dropout — is drawn from the
same state on every run, and what earlier stages of the same process drew (the flow runs
stages one after another in one process) does not leak into the next one.

Bit-identity holds for the same params, code, inputs, library versions, device and torch
thread count: float reductions are split across intra-op threads, and kernels differ between
CPU types and GPUs. `environment()` is what a stage's output depends on beyond its
fingerprint; the runner writes it into the manifest (`determinism`), so two outputs that
differ can be told apart by it.
"""
from __future__ import annotations

import os
import platform
import random
from typing import Any

# cuBLAS reuses workspaces across streams unless told otherwise, which makes its matmuls order-dependent
# (PyTorch's reproducibility notes); it must be in the environment before the first cuBLAS call
CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (every device's) global RNGs with `seed`; ask torch for
    deterministic kernels (a warning, not an error, where an op has none)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for torch
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing, so by chance
    torch.backends.cudnn.deterministic = True


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container
    limited to 2 CPUs on a 64-core host has 2, where os.cpu_count() says 64)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota else max(1, cores)


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None when unlimited."""
    try:
        quota, period = open(f"{root}/cpu.max").read().split()  # cgroup v2: "200000 100000" or "max 100000"
    except (OSError, ValueError):
        try:
            quota = open(f"{root}/cpu/cpu.cfs_quota_us").read().strip()  # cgroup v1: -1 when unlimited
            period = open(f"{root}/cpu/cpu.cfs_period_us").read().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def resolve_threads(threads: int | str, sharing: int = 1) -> int:
    """`run.threads` as a number: an int as given; "auto": the available cores, split between the
    `sharing` processes that run at once on this machine (shards, launched ranks)."""
    if threads == "auto":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of a launch on this machine
        return max(1, available_cores() // max(1, sharing, local))
    return int(threads)


def set_threads(threads: int | str, sharing: int = 1) -> int:
    """Set torch's intra-op threads from `run.threads` (see `resolve_threads`); returns the count.

    One thread is the default because one thread per core collapses on a shared machine: a second
    CPU-bound process makes OpenMP threads wait on a busy core, where one thread keeps its core's speed
    (docs/decisions.md); and outputs then do not depend on the machine's core count (float sums are
    split across threads)."""
    import torch

    n = resolve_threads(threads, sharing)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def prepare(run, sharing: int = 1) -> None:
    """What the runner does before every stage, shard and launched rank draws anything: torch's threads
    from `run.threads` (split between `sharing` processes for "auto"), then every RNG from `run.seed`."""
    set_threads(run.threads, sharing)
    seed_everything(run.seed)


def environment(device: str = "auto") -> dict[str, Any]:
    """What a stage's outputs depend on beyond its params, code and inputs (the library versions are
    in the manifest's `versions`): torch's thread count, the CPU, the GPU (`device`: run.device)."""
    import torch

    out: dict[str, Any] = {
        "torch_num_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device in ("auto", "cuda") and torch.cuda.is_available():
        out["cuda"] = {"device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version(),
                       "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    return out


def _cpu_model() -> str:
    """The CPU's model name (kernels are chosen per instruction set), or platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
