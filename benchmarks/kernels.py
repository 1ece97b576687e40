"""Time and peak memory of stages.kernels against the naive torch computations.

Usage::

    python -m benchmarks kernels            # full sizes (~2-3 min on 2 CPU cores)
    python -m benchmarks kernels --tiny     # small sizes, a few seconds
    python -m benchmarks kernels --repeats 7 --clp-repeats 3 --device cuda

Cases:

- ``selective_log_softmax`` vs ``logits.log_softmax(-1).gather(...)`` at (B=8, T=512,
  V=32000) in float32 and bfloat16, forward and backward;
- ``chunked_logprobs`` vs the logits path (``lm_head`` matmul to full ``(N, V)`` logits,
  then either the naive log_softmax+gather or ``selective_log_softmax``) at (N=8192,
  H=512, V=32000) in float32, forward and backward.

Memory: every variant runs once in a fresh subprocess, so nothing freed by another run
can hide in (or be reused from) the allocator. On CPU the child allocates its inputs,
resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs`` resets
``VmHWM``), records ``VmRSS`` as the baseline and reads ``VmHWM`` after the forward and
after the backward: "peak extra" is that high-water mark minus the baseline, i.e. the
memory the computation needed beyond its inputs (outputs and gradients included). Where
``clear_refs`` is not writable it falls back to ``getrusage().ru_maxrss``. On CUDA it uses
``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` after the inputs.

Timing: the variants of one case run round-robin in one process (so all see the same
background load), after a warm-up on tiny inputs; the table shows the minimum over
``--repeats`` rounds (``--clp-repeats`` for chunked_logprobs): shared/virtualised CPUs
add noise upward, so the minimum is the stable statistic.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, PeakMemory

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
    "tiny": {"sls": dict(B=4, T=256, V=8000), "clp": dict(N=2048, H=256, V=8000)},
}


# ------------------------------------------------------------------------ child side



def _make(kind: str, dtype_name: str, variant: str, sizes: dict, device: str):
    """Inputs plus `forward() -> output` and `backward(output)` closures for one case."""
    import torch
    import torch.nn.functional as F

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


def _child_memory(name: str, size_key: str, device: str) -> dict:
    """Peak extra memory of one forward+backward of one variant, in this fresh process."""
    kind, dtype_name, variant = CASES[name]
    sizes = SIZES[size_key][kind]
    _warmup(kind, dtype_name, variant, sizes, device)
    forward, backward, _ = _make(kind, dtype_name, variant, sizes, device)
    meter = PeakMemory(device)
    meter.start()
    out = forward()
    fwd_peak = meter.peak()
    backward(out)
    return dict(name=name, fwd_peak_mib=fwd_peak, total_peak_mib=meter.peak(), method=meter.method)


def _warmup(kind, dtype_name, variant, sizes, device) -> None:
    # Initialise kernels/libraries on tiny inputs so measured runs do not pay one-off
    # set-up costs, without leaving big freed blocks behind in the heap.
    tiny = {k: (min(v, 32) if k == "H" else min(v, 64)) for k, v in sizes.items()}
    forward, backward, _ = _make(kind, dtype_name, variant, tiny, device)
    backward(forward())


def _child_time(group: str, size_key: str, device: str, repeats: int) -> list[dict]:
    """Time all variants of one group round-robin in one process; keep the minimum of each.

    Interleaving puts every variant under the same background load, which matters on
    shared machines where a 2x swing between consecutive identical runs is common.
    """
    import torch

    names = [n for n in CASES if n.startswith(group + "-")]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    runs = {}
    for name in names:
        kind, dtype_name, variant = CASES[name]
        _warmup(kind, dtype_name, variant, SIZES[size_key][kind], device)
        runs[name] = _make(kind, dtype_name, variant, SIZES[size_key][kind], device)
    times = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            forward, backward, params = runs[name]
            gc.collect()
            sync()
            t0 = time.perf_counter()
            out = forward()
            sync()
            t1 = time.perf_counter()
            backward(out)
            sync()
            t2 = time.perf_counter()
            del out
            for p in params:
                p.grad = None
            times[name].append((t1 - t0, t2 - t1))
    results = []
    for name in names:
        kind, dtype_name, variant = CASES[name]
        ts = times[name]
        results.append(dict(
            name=name, kind=kind, dtype=dtype_name, variant=variant, sizes=SIZES[size_key][kind],
            fwd_s=min(f for f, _ in ts), bwd_s=min(b for _, b in ts), total_s=min(f + b for f, b in ts),
            threads=torch.get_num_threads(),
        ))
    return results


# ----------------------------------------------------------------------- parent side


def _child_json(extra: list[str], args) -> object:
    cmd = [sys.executable, "-m", "benchmarks", "kernels", "--device", args.device, *extra]
    if args.tiny:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_sizes(s: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.items())


def _table(results: list[dict]) -> list[str]:
    head = ("| kernel | shape | dtype | variant | fwd ms | bwd ms | fwd+bwd ms | fwd peak extra MiB "
            "| fwd+bwd peak extra MiB |")
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
    # Headline: forward + backward, what a training step pays. The gradient of the logits is
    # itself one logits-sized tensor, so fwd+bwd memory cannot go under 1/3 of the naive path's
    # 3 (logits, log-softmax, its gradient); the forward-only figures follow as information.
    out.append(check("selective_log_softmax fp32 fwd+bwd peak extra memory vs naive",
                     ratio(ours["total_peak_mib"], naive["total_peak_mib"]), 0.25))
    out.append(check("selective_log_softmax fp32 fwd+bwd time vs naive",
                     ratio(ours["total_s"], naive["total_s"]), 1.2))
    out.append(check("selective_log_softmax fp32 forward-only peak extra memory vs naive (info)",
                     ratio(ours["fwd_peak_mib"], naive["fwd_peak_mib"]), 0.25))
    out.append(check("selective_log_softmax fp32 forward-only time vs naive (info)",
                     ratio(ours["fwd_s"], naive["fwd_s"]), 1.2))
    for key, label in (("clp-fp32-logits", "logits path, naive log_softmax"),
                       ("clp-fp32-logits-sls", "logits path + selective_log_softmax")):
        ref = by[key]
        out.append(check(f"chunked_logprobs fwd+bwd peak extra memory vs {label}",
                         ratio(by["clp-fp32-ours"]["total_peak_mib"], ref["total_peak_mib"]), 0.30))
        out.append(check(f"chunked_logprobs fwd+bwd time vs {label}",
                         ratio(by["clp-fp32-ours"]["total_s"], ref["total_s"]), 1.5))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, 1 repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed selective_log_softmax runs per variant (min)")
    parser.add_argument("--clp-repeats", type=int, default=2, help="timed chunked_logprobs runs per variant (min)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-time", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny and not (args.child_memory or args.child_time):
        args.repeats, args.clp_repeats = 1, 1
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    size_key = "tiny" if args.tiny else "full"
    if args.child_memory:
        print(json.dumps(_child_memory(args.child_memory, size_key, args.device)))
        return 0
    if args.child_time:
        print(json.dumps(_child_time(args.child_time, size_key, args.device, args.repeats)))
        return 0

    start = time.perf_counter()
    memory = {}
    for name in CASES:
        print(f"memory: {name} ...", file=sys.stderr, flush=True)
        memory[name] = _child_json(["--child-memory", name], args)
    results = []
    for group, repeats in (("sls-fp32", args.repeats), ("sls-bf16", args.repeats), ("clp-fp32", args.clp_repeats)):
        print(f"time: {group} x{repeats} ...", file=sys.stderr, flush=True)
        for r in _child_json(["--child-time", group, "--repeats", str(repeats)], args):
            results.append({**r, **memory[r["name"]]})
    by = {r["name"]: r for r in results}
    cpu = os.cpu_count()
    print(f"device={args.device} cpus={cpu} torch threads={results[0]['threads']} "
          f"repeats={args.repeats} (chunked_logprobs {args.clp_repeats}) memory method={results[0]['method']} "
          f"({size_key} sizes, {time.perf_counter() - start:.0f} s)")
    print()
    print("\n".join(_table(results)))
    print()
    if args.tiny:
        print("(tiny sizes: the chunk budgets are sized for the full shapes, so the targets below are only "
              "meaningful without --tiny)")
    print("\n".join(_targets(by)))
    return 0
