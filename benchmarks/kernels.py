"""Time and peak memory of stages.kernels against the naive torch computations.

Usage::

    python benchmarks/kernels.py            # full sizes (~2-3 min on 2 CPU cores)
    python benchmarks/kernels.py --quick    # small sizes, a few seconds
    python benchmarks/kernels.py --repeats 5 --device cuda

Cases:

- ``selective_log_softmax`` vs ``logits.log_softmax(-1).gather(...)`` at (B=8, T=512,
  V=32000) in float32 and bfloat16, forward and backward;
- ``chunked_logprobs`` vs the logits path (``lm_head`` matmul to full ``(N, V)`` logits,
  then either the naive log_softmax+gather or ``selective_log_softmax``) at (N=8192,
  H=512, V=32000) in float32, forward and backward.

Memory method. Every variant runs in a fresh subprocess, so nothing freed by another
variant can hide in the allocator. On CPU the child allocates its inputs, resets the
kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs`` resets ``VmHWM``), records
``VmRSS`` as the baseline and reads ``VmHWM`` after the forward and after the backward
of the *first* run: "peak extra" is that high-water mark minus the baseline, i.e. the
memory the computation needed beyond its inputs (outputs and gradients included). Where
``clear_refs`` is not writable it falls back to ``getrusage().ru_maxrss``. On CUDA it uses
``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` after the inputs.

Timing: the minimum over ``--repeats`` runs (shared/virtualised CPUs mostly add noise
upward, so the minimum is the stable statistic).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (kind, dtype, variant)
CASES = {
    "sls-fp32-naive": ("sls", "float32", "naive"),
    "sls-fp32-ours": ("sls", "float32", "ours"),
    "sls-bf16-naive": ("sls", "bfloat16", "naive"),
    "sls-bf16-ours": ("sls", "bfloat16", "ours"),
    "clp-fp32-logits": ("clp", "float32", "logits+naive"),
    "clp-fp32-logits-sls": ("clp", "float32", "logits+selective"),
    "clp-fp32-ours": ("clp", "float32", "ours"),
}
SIZES = {
    "full": {"sls": dict(B=8, T=512, V=32000), "clp": dict(N=8192, H=512, V=32000)},
    "quick": {"sls": dict(B=4, T=256, V=8000), "clp": dict(N=2048, H=256, V=8000)},
}


# ------------------------------------------------------------------------ child side


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


class _Meter:
    """Peak extra memory (MiB) since `start()`, by the most reliable method available."""

    def __init__(self, device: str):
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
            self.base = _status_mib("VmRSS")
        except OSError:
            # No reset possible: ru_maxrss is a lifetime peak, so this is only valid if
            # nothing before this point used more memory than the inputs do now.
            self.method = "ru_maxrss"
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**20 - self.base
        if self.method == "VmHWM":
            return _status_mib("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.base


def _make(kind: str, dtype_name: str, variant: str, sizes: dict, device: str):
    """Inputs plus `forward() -> output` and `backward(output)` closures for one case."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from stages.kernels import chunked_logprobs, selective_log_softmax

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(0)
    if kind == "sls":
        B, T, V = sizes["B"], sizes["T"], sizes["V"]
        logits = torch.randn(B, T, V, generator=gen, dtype=dtype, device=device).requires_grad_()
        index = torch.randint(0, V, (B, T), generator=gen, device=device)
        grad = torch.randn(B, T, generator=gen, dtype=dtype, device=device)
        params = [logits]
        if variant == "naive":
            def forward():
                return logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        else:
            def forward():
                return selective_log_softmax(logits, index)
    else:
        N, H, V = sizes["N"], sizes["H"], sizes["V"]
        hidden = torch.randn(N, H, generator=gen, dtype=dtype, device=device).requires_grad_()
        weight = torch.randn(V, H, generator=gen, dtype=dtype, device=device).mul_(0.05).requires_grad_()
        index = torch.randint(0, V, (N,), generator=gen, device=device)
        grad = torch.randn(N, generator=gen, dtype=torch.float32, device=device)
        params = [hidden, weight]
        if variant == "logits+naive":
            def forward():
                z = F.linear(hidden, weight).float()
                return z.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        elif variant == "logits+selective":
            def forward():
                return selective_log_softmax(F.linear(hidden, weight).float(), index)
        else:
            def forward():
                return chunked_logprobs(hidden, weight, index)

    def backward(out):
        for p in params:
            p.grad = None
        out.backward(grad)

    return forward, backward, params


def _child(name: str, size_key: str, device: str, repeats: int) -> dict:
    import torch

    kind, dtype_name, variant = CASES[name]
    sizes = SIZES[size_key][kind]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    # Warm up kernels/libraries on tiny inputs so the first measured run is not paying
    # one-off initialisation, without leaving big freed blocks in the heap.
    tiny = {k: (min(v, 64) if k != "H" else min(v, 32)) for k, v in sizes.items()}
    f, b, _ = _make(kind, dtype_name, variant, tiny, device)
    b(f())
    del f, b

    forward, backward, params = _make(kind, dtype_name, variant, sizes, device)
    meter = _Meter(device)
    fwd_t, bwd_t = [], []
    fwd_peak = total_peak = None
    for i in range(repeats):
        if i == 0:
            meter.start()
        sync()
        t0 = time.perf_counter()
        out = forward()
        sync()
        t1 = time.perf_counter()
        if i == 0:
            fwd_peak = meter.peak()
        backward(out)
        sync()
        t2 = time.perf_counter()
        if i == 0:
            total_peak = meter.peak()
        del out
        for p in params:
            p.grad = None
        fwd_t.append(t1 - t0)
        bwd_t.append(t2 - t1)
    return dict(
        name=name,
        kind=kind,
        dtype=dtype_name,
        variant=variant,
        sizes=sizes,
        fwd_s=min(fwd_t),
        bwd_s=min(bwd_t),
        total_s=min(a + c for a, c in zip(fwd_t, bwd_t)),
        fwd_peak_mib=fwd_peak,
        total_peak_mib=total_peak,
        method=meter.method,
        threads=torch.get_num_threads(),
    )


# ----------------------------------------------------------------------- parent side


def _run_case(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--device", args.device, "--repeats", str(args.repeats)]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_sizes(s: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.items())


def _table(results: list[dict]) -> list[str]:
    head = "| kernel | shape | dtype | variant | fwd ms | bwd ms | fwd+bwd ms | fwd peak extra MiB | fwd+bwd peak extra MiB |"
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        kernel = "selective_log_softmax" if r["kind"] == "sls" else "chunked_logprobs"
        lines.append(
            f"| {kernel} | {_fmt_sizes(r['sizes'])} | {r['dtype']} | {r['variant']} | "
            f"{r['fwd_s'] * 1e3:.0f} | {r['bwd_s'] * 1e3:.0f} | {r['total_s'] * 1e3:.0f} | "
            f"{r['fwd_peak_mib']:.0f} | {r['total_peak_mib']:.0f} |"
        )
    return lines


def _targets(by: dict) -> list[str]:
    def ratio(a, b):
        return a / b if b > 0 else float("inf")

    def check(label, value, limit):
        return f"- {label}: {value:.2f}x (target <= {limit}x) -> {'MET' if value <= limit else 'MISSED'}"

    out = []
    ours, naive = by["sls-fp32-ours"], by["sls-fp32-naive"]
    out.append(check("selective_log_softmax fp32 forward peak extra memory vs naive",
                     ratio(ours["fwd_peak_mib"], naive["fwd_peak_mib"]), 0.25))
    out.append(check("selective_log_softmax fp32 forward time vs naive", ratio(ours["fwd_s"], naive["fwd_s"]), 1.2))
    out.append(check("selective_log_softmax fp32 fwd+bwd peak extra memory vs naive (info)",
                     ratio(ours["total_peak_mib"], naive["total_peak_mib"]), 1.0))
    out.append(check("selective_log_softmax fp32 fwd+bwd time vs naive (info)",
                     ratio(ours["total_s"], naive["total_s"]), 1.2))
    for key, label in (("clp-fp32-logits", "logits path, naive log_softmax"),
                       ("clp-fp32-logits-sls", "logits path + selective_log_softmax")):
        ref = by[key]
        out.append(check(f"chunked_logprobs fwd+bwd peak extra memory vs {label}",
                         ratio(by["clp-fp32-ours"]["total_peak_mib"], ref["total_peak_mib"]), 0.30))
        out.append(check(f"chunked_logprobs fwd+bwd time vs {label}",
                         ratio(by["clp-fp32-ours"]["total_s"], ref["total_s"]), 1.5))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (min is reported)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print(json.dumps(_child(args.child, "quick" if args.quick else "full", args.device, args.repeats)))
        return

    start = time.perf_counter()
    results = []
    for name in CASES:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append(_run_case(name, args))
    by = {r["name"]: r for r in results}
    cpu = os.cpu_count()
    print(f"device={args.device} cpus={cpu} torch threads={results[0]['threads']} "
          f"repeats={args.repeats} memory method={results[0]['method']} "
          f"({'quick' if args.quick else 'full'} sizes, {time.perf_counter() - start:.0f} s)")
    print()
    print("\n".join(_table(results)))
    print()
    print("\n".join(_targets(by)))


if __name__ == "__main__":
    main()
