"""torch intra-op threads on the built-in model: 1 thread vs N, idle and beside CPU-bound processes.

    python benchmarks/threads.py                 # 1 vs 2 threads, idle, then beside 1 busy process
    python benchmarks/threads.py --busy 0        # idle only
    python benchmarks/threads.py --model artifacts/sft/model --threads 1 2 4
    python benchmarks/threads.py --busy 0 --threads 1 --precision fp32 bf16   # bf16 autocast vs fp32

What `run.threads` (README "Threads") decides. Two workloads of the pipeline, on the built-in
model (`builtin:tiny` as params.yaml builds it, or `--model`): an SFT-sized training step (batch
32 x 50 tokens, AdamW) and a batched greedy generation (256 rows, 24 new tokens, KV cache). Each
thread count runs in its own fresh process (an OpenMP pool, once started, keeps its threads), the
counts alternated over `--rounds` rounds; the figure is the best round's median seconds. The busy
neighbours are CPU-bound processes doing 512x512 matmuls on one thread each
(`benchmarks/pipeline.py`'s `BUSY`), started before and killed after each measurement. Prints the
load average beside every row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.pipeline import neighbours  # noqa: E402

WORKER = r"""
import json, statistics, sys, time, torch
threads, path, steps, bf16 = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "bf16"
torch.set_num_threads(threads)
torch.manual_seed(0)
from transformers import AutoModelForCausalLM
from stages.trainers.precision import use_fp32_cpu_attention
m = AutoModelForCausalLM.from_pretrained(path)
use_fp32_cpu_attention(m)  # as our trainers run it: attention in fp32 under CPU autocast
opt = torch.optim.AdamW(m.parameters(), 1e-4)
x = torch.randint(0, m.config.vocab_size, (32, 50))
prompts = torch.randint(0, m.config.vocab_size, (256, 16))

def train():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = m(input_ids=x, labels=x).loss
    loss.backward(); opt.step(); opt.zero_grad()

@torch.no_grad()
def generate():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        m.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24, min_new_tokens=24,
               do_sample=False, pad_token_id=0)

out = {}
for name, fn, n in (("train step", train, steps), ("generation", generate, max(2, steps // 4))):
    fn(); fn()  # warm-up: the thread pool, allocator, kernels
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def measure(threads: int, path: str, steps: int, precision: str = "fp32") -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run([sys.executable, "-c", WORKER, str(threads), path, str(steps), precision], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def builtin_model(folder: Path) -> str:
    from stages.builtin import tiny
    from stages.params_loader import load_params

    b = load_params(REPO / "params.yaml").model.builtin
    return str(tiny.build(folder / "tiny", hidden_size=b.hidden_size, num_layers=b.num_layers, num_heads=b.num_heads,
                          intermediate_size=b.intermediate_size, vocab_size=b.vocab_size, seed=b.seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model folder (default: builtin:tiny as params.yaml builds it)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="numbers of busy neighbours to measure beside")
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                    help="bf16: the steps under torch's CPU bf16 autocast (fp32 master weights)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or builtin_model(Path(tmp))
        print(f"{'busy':>4} {'threads':>7} {'precision':>9} {'train step s':>12} {'generation s':>12} {'load':>5}")
        variants = [(t, p) for t in args.threads for p in args.precision]
        for busy in args.busy:
            best: dict[tuple, dict[str, float]] = {}
            with neighbours(busy, 1):
                time.sleep(1.0 if busy else 0.0)
                for _ in range(args.rounds):
                    for v in variants:  # alternated: every variant sees the same load over the rounds
                        got = measure(*v[:1], path, args.steps, v[1])
                        best[v] = {k: min(x, best.get(v, {}).get(k, x)) for k, x in got.items()}
                load = os.getloadavg()[0]
            for v in variants:
                print(f"{busy:>4} {v[0]:>7} {v[1]:>9} {best[v]['train step']:>12.4f} {best[v]['generation']:>12.4f} "
                      f"{load:>5.2f}")
            base = best[variants[0]]
            for v in variants[1:]:
                print(f"     speed of {v[0]} threads {v[1]} / {variants[0][0]} {variants[0][1]}: train "
                      f"{base['train step'] / best[v]['train step']:.2f}x, generation "
                      f"{base['generation'] / best[v]['generation']:.2f}x")


if __name__ == "__main__":
    main()
