"""How fast a decode step's matmuls stream a model's weights: the layouts the CPU decoder could use, in GB/s.

    OMP_NUM_THREADS=1 python -m benchmarks decode_matmul            # SmolLM2-135M's shapes, 8/16/64 rows
    python -m benchmarks decode_matmul --rows 16 --repeats 5
    python -m benchmarks decode_matmul --tiny                       # a smoke run (small weights, seconds)

A decode step multiplies a few rows (the batch's last tokens) by every weight of the model. With weights larger
than the caches (SmolLM2-135M: 540 MB in fp32) the step is bound by reading them, so the figure is GB of weights
per second. For each row count, over weights of two shapes (a stack of MLP matrices of 3,072 x 576 and an lm-head
of 49,152 x 576, each set larger than the last-level cache):
- `mm` on an (in, out) copy: `torch.mm(x, w.T.contiguous())`, the layout the decoder first used (the copy itself
  is timed once: a full pass over the weights per generate call; "copy GB/s");
- `F.linear` in place: on the model's own (out, in) weights, no copy;
- oneDNN packed (what the decoder runs): `torch.ops.mkldnn._linear_pointwise` on a copy reordered once for that
  row count (`torch.ops.mkldnn._reorder_linear_weight`; the reorder is timed too: "reorder GB/s");
- MKL packed: `torch.ops.mkl._mkl_linear` on a copy from `torch.ops.mkl._mkl_reorder_linear_weight`, as fast, but
  its buffers are several times a small weight's size (the decoder's heap grew by a weight copy per call with it).
Either is left out of torch builds without it.
And the plain read (`w.sum()`) of the same bytes, the bound. Each figure is the best of `--repeats` passes, the
variants round-robin in one process.

Then a second table: the decoder's own `_Linear` over every layer of SmolLM2-135M (30 layers of q/k/v, o, gate/up
and down), oneDNN packed at the row count, each projection its own call against q/k/v and gate/up as one matrix
each (what the decoder runs: 4 calls a layer instead of 7), in GB/s of the layers' weights.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import host_load

SHAPES = {"mlp 3072x576 x40": ((3072, 576), 40), "lm-head 49152x576 x3": ((49152, 576), 3)}
TINY = {"mlp 256x64 x8": ((256, 64), 8)}
# a Llama layer's projections: hidden, key/value width, MLP width, layers (SmolLM2-135M; --tiny: a small one)
LAYERS, TINY_LAYERS = (576, 192, 1536, 30), (64, 32, 128, 2)


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape, count: int, rows: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    weights = [torch.randn(*shape) for _ in range(count)]
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    start = time.perf_counter()
    transposed = [w.t().contiguous() for w in weights]
    copy_s = time.perf_counter() - start
    mkl_ok = torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")
    onednn_ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    out = []
    for m in rows:
        x = torch.randn(m, shape[1])
        variants = {"read": lambda: [w.sum() for w in weights],
                    "mm (in, out) copy": lambda x=x: [torch.mm(x, w) for w in transposed],
                    "F.linear in place": lambda x=x: [F.linear(x, w) for w in weights]}
        row = {"rows": m, "copy GB/s": gb / copy_s}
        if onednn_ok:
            start = time.perf_counter()
            reordered = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
            row["reorder GB/s"] = gb / (time.perf_counter() - start)
            variants["oneDNN packed"] = lambda x=x, reordered=reordered: [
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in reordered]
        if mkl_ok:
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            variants["MKL packed"] = lambda x=x, m=m, packed=packed: [
                torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(packed, weights, strict=True)]
        seconds = {name: float("inf") for name in variants}
        for _ in range(repeats):  # round-robin: a load change hits every variant
            for name, fn in variants.items():
                seconds[name] = min(seconds[name], best(fn, 1))
        row.update({name: gb / s for name, s in seconds.items()})
        out.append(row)
    return out


def measure_layers(hidden: int, kv: int, mlp: int, layers: int, rows: list[int], repeats: int) -> list[dict]:
    """GB/s of the layers' weights through the decoder's `_Linear`, packed: one call per projection, or per group."""
    import torch

    from stages.generation.decoder import GROUPS, _Linear

    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (mlp, hidden), "up_proj": (mlp, hidden), "down_proj": (hidden, mlp)}
    weights = [{name: torch.randn(*shape) for name, shape in shapes.items()} for _ in range(layers)]
    gb = sum(w.numel() * w.element_size() for layer in weights for w in layer.values()) / 1e9
    variants = {"one call per projection": [[_Linear([w], [None]) for w in layer.values()] for layer in weights],
                "q/k/v and gate/up grouped": [[_Linear([layer[n] for n in names], [None] * len(names))
                                               for names in GROUPS.values()] for layer in weights]}
    out = []
    for m in rows:
        x = {hidden: torch.randn(m, hidden), mlp: torch.randn(m, mlp)}
        for linears in variants.values():
            for layer in linears:
                for linear in layer:
                    linear.pack(m)
        seconds = {name: float("inf") for name in variants}
        for _ in range(repeats):  # round-robin, as above
            for name, linears in variants.items():
                seconds[name] = min(seconds[name], best(
                    lambda linears=linears, x=x: [lin.parts(x[lin.weights[0].shape[1]]) for layer in linears
                                             for lin in layer], 1))
        out.append({"rows": m, **{name: gb / s for name, s in seconds.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m benchmarks decode_matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="small weights, 1 repeat: a smoke run")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes, repeats = (TINY, 1) if a.tiny else (SHAPES, a.repeats)
    print(f"torch {torch.__version__}, {a.threads} thread(s), load {host_load():.2f}; GB of fp32 weights per second, "
          f"best of {repeats}")
    columns = ["read", "mm (in, out) copy", "F.linear in place", "oneDNN packed", "MKL packed", "copy GB/s",
               "reorder GB/s"]
    print("\n| weights | rows | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for name, (shape, count) in shapes.items():
        for row in measure(shape, count, a.rows, repeats):
            cells = [f"{row[c]:.1f}" if c in row else "n/a" for c in columns]
            print(f"| {name} | {row['rows']} | " + " | ".join(cells) + " |")
    from stages.generation.decoder import PACKED_LINEAR

    if PACKED_LINEAR:
        hidden, kv, mlp, layers = TINY_LAYERS if a.tiny else LAYERS
        names = ["one call per projection", "q/k/v and gate/up grouped"]
        print(f"\n{layers} layers of q/k/v, o, gate/up, down (hidden {hidden}, key/value {kv}, MLP {mlp}), the "
              f"decoder's packed linears, GB/s of weights")
        print("\n| rows | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for row in measure_layers(hidden, kv, mlp, layers, a.rows, repeats):
            print(f"| {row['rows']} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")
    return 0
