"""Generation throughput: batched `stages.generation.generate` against one prompt per call, and each backend.

    python -m benchmarks generation                         # 256 prompts x 4 samples, ~1 min on 2 CPU cores
    python -m benchmarks generation --model artifacts/sft/model   # a trained SFT model instead of a fresh one
    python -m benchmarks generation --prompts 2 --samples 4 # 8 rows: an online trainer's sampling batch
    python -m benchmarks generation --tiny                  # a smoke run (seconds)
    python -m benchmarks generation --device cuda           # on a GPU (the decoder is CPU-only: auto = hf there)

Workload: the first `--prompts` prompts of the built-in task (chat form), `--samples` samples each
(temperature 1, `--max-new-tokens` 32), on a fresh built-in Llama (hidden 128, 4 layers) or `--model`.
Variants of the same call, `generate(model, tok, prompts, SamplingParams(n=4, do_sample=True, ...))`:
- batched (backend auto) against one prompt per call (`batch_size=1`): what batching buys;
- batched through HF's own batch sampler (`model.generate(do_sample=True)`, torch's global RNG) against
  `backend="hf"`: what seeding each prompt's rows apart (`stages.generation.per_row_sampler`) costs;
- batched with `backend="hf"` and `backend="decoder"`: what the CPU decoder buys over HF `generate`.
Throughput = generated tokens (EOS included) / wall time, the best of `--repeats` rounds run round-robin
after an untimed warm-up. It also checks that greedy decoding gives the same tokens batched and one at a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import host_load

BATCHED, ONE = "batched (auto)", "one prompt at a time"
HF_SAMPLER = "batched, HF's sampler"
BACKENDS = {"batched, backend hf": "hf", "batched, backend decoder": "decoder"}


def build_model(args, folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.builtin import tiny

    path = Path(args.model) if args.model else tiny.build(
        folder / "tiny", hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=4,
        intermediate_size=4 * args.hidden_size, vocab_size=384, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
    return path, model, tok


def task_prompts(n: int) -> list:
    from stages.builtin import arithmetic
    from stages.harness.config import ArithmeticConfig

    cfg = dataclasses.asdict(ArithmeticConfig(num_train=10, num_preference=n, num_eval=10, num_dev=0))
    return [r["prompt"] for r in arithmetic.generate(**cfg)["prompts"]][:n]


def hf_batch_sampler(model, tok, prompts, sampling, batch_size: int) -> list[list[int]]:
    """HF's own sampler over the same left-padded, length-sorted batches (what `generate` did before per-prompt
    seeds): the reference for the per-row sampler's cost."""
    import torch

    from stages.data.tokenize import render_prompt
    from stages.generation.common import eos_token_ids, trim_at_eos
    from stages.tensors import pad

    eos = eos_token_ids(tok, model)
    ids = tok([render_prompt(tok, p) for p in prompts], add_special_tokens=False)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = []
    with torch.no_grad():
        torch.manual_seed(sampling.seed)
        for start in range(0, len(order), batch_size):
            rows = [torch.tensor(ids[i]) for i in order[start:start + batch_size]]
            x = pad(rows, tok.pad_token_id, "left").to(model.device)
            mask = pad([torch.ones_like(r) for r in rows], 0, "left").to(model.device)
            gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                 do_sample=True, top_k=0, num_return_sequences=sampling.n, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
            out += [trim_at_eos(r, eos) for r in gen[:, x.shape[1]:].tolist()]
    return out


def timed(fn):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model folder (e.g. an SFT model); default: the built-in tiny model")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="hidden 32, 1 layer, 8 prompts, 8 tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.tiny:
        args.hidden_size, args.num_layers, args.prompts, args.max_new_tokens, args.repeats = 32, 1, 8, 8, 1

    import torch

    from stages.generation import SamplingParams, generate

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        path, model, tok = build_model(args, Path(tmp))
        prompts = task_prompts(args.prompts)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.samples, do_sample=True, seed=0)
        variants = {BATCHED: args.batch_size, ONE: 1, HF_SAMPLER: args.batch_size,
                    **{name: args.batch_size for name in BACKENDS}}
        runnable = {name: b for name, b in BACKENDS.items() if b != "decoder" or args.device == "cpu"}
        variants = {k: v for k, v in variants.items() if k not in BACKENDS or k in runnable}
        for bs in variants.values():  # warm-up: allocator, kernels, first-call overheads
            generate(model, tok, prompts[:2], sampling, batch_size=bs)
        best: dict[str, tuple[float, int, float]] = {}
        for _ in range(repeats):
            for name, bs in variants.items():
                # each lambda is timed at once, inside its iteration (what B023 guards against is a late call)
                if name == HF_SAMPLER:
                    comps, secs = timed(lambda: hf_batch_sampler(model, tok, prompts, sampling, bs))  # noqa: B023
                    finished = sum(bool(c) and c[-1] in (tok.eos_token_id,) for c in comps) / len(comps)
                else:
                    backend = BACKENDS.get(name, "auto")
                    gens, secs = timed(lambda: generate(model, tok, prompts, sampling, batch_size=bs,  # noqa: B023
                                                        backend=backend))  # noqa: B023
                    comps, finished = gens.completion_ids, sum(gens.finished) / len(gens)
                tokens = sum(map(len, comps))
                if name not in best or secs < best[name][0]:
                    best[name] = (secs, tokens, finished)
        same_greedy = None
        if not args.tiny:
            greedy, check = SamplingParams(max_new_tokens=args.max_new_tokens), prompts[:32]
            batched = generate(model, tok, check, greedy, batch_size=args.batch_size).completion_ids
            single = [generate(model, tok, [p], greedy).completion_ids[0] for p in check]
            same_greedy = batched == single

    print(f"model {path}, {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
          f"device {args.device}, {args.threads} thread(s), 1-min load {host_load():.2f}")
    rate = {}
    for name, (secs, tokens, finished) in best.items():
        rate[name] = tokens / secs
        print(f"{name:>25}: batch_size={variants[name]:>3}  {secs:7.2f} s  {tokens:6d} tokens  "
              f"{tokens / secs:9.0f} tokens/s  finished {finished:.0%}")
    print(f"batched / one at a time, tokens/s: {rate[BATCHED] / rate[ONE]:.2f}x")
    print(f"per-prompt seeded sampler / HF's batch sampler (both through HF generate), tokens/s: "
          f"{rate['batched, backend hf'] / rate[HF_SAMPLER]:.2f}x")
    if "batched, backend decoder" in rate:
        print(f"backend decoder / backend hf, tokens/s: "
              f"{rate['batched, backend decoder'] / rate['batched, backend hf']:.2f}x")
    if same_greedy is not None:
        print(f"greedy tokens identical batched vs one at a time (32 prompts): {same_greedy}")
    return 0

