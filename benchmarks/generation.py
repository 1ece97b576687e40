"""Generation throughput: batched `stages.generation.generate` vs one prompt per call.

Usage::

    python benchmarks/generation.py                       # 256 prompts x 4 samples, ~1 min on 2 CPU cores
    python benchmarks/generation.py --model runs/sft/model  # a trained SFT model instead of the fresh tiny one
    python benchmarks/generation.py --prompts 64 --quick  # smoke run
    python benchmarks/generation.py --device cuda         # on a GPU

Workload: the first `--prompts` prompts of the built-in task (`builtin:arithmetic`, chat
form, rendered with the chat template), `--samples` samples each (sampling, temperature 1,
`--max-new-tokens` 32), on the built-in tiny Llama (hidden 128, 4 layers; built into a
temporary folder) or the model given with `--model`.

Two variants of the same call, `generate(model, tok, prompts, SamplingParams(n=4, do_sample=True, ...))`:
- batched: `batch_size=--batch-size` prompts (x 4 samples) per `model.generate`, left-padded, KV cache;
- one at a time: `batch_size=1`, i.e. one `model.generate` per prompt (its 4 samples together);
and, for the cost of seeding every prompt's rows apart (`stages.generation.row_sampling`), a third:
- batched, HF's sampler: the same batches through `model.generate(do_sample=True, num_return_sequences=4)`
  directly, which samples the whole batch from torch's global RNG (not prompt-seeded);
and, for the "hf" backend's decoder (`stages.generation.decoder`, on by default where it applies), a fourth:
- batched, HF's generate: the batched call with the decoder turned off (every batch through `model.generate`).
Throughput = generated tokens (up to and including EOS) / wall time, minimum over `--repeats`
rounds run round-robin so both see the same background load, after an untimed warm-up.
It also checks that greedy decoding gives identical tokens batched and one at a time.
Writes benchmarks/RESULTS-generation.md (with --write).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HF_SAMPLER = "batched, HF's sampler"
HF_GENERATE = "batched, HF's generate"


def hf_generate_only(fn):
    """`fn()` with the "hf" backend's decoder turned off: every batch through HF's `model.generate`."""
    from stages.generation.decoder import Decoder

    real = Decoder.for_model
    Decoder.for_model = classmethod(lambda cls, model, capacity: None)
    try:
        return fn()
    finally:
        Decoder.for_model = real


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
    from stages.config import ArithmeticConfig

    cfg = dataclasses.asdict(ArithmeticConfig(num_train=10, num_preference=n, num_eval=10, num_dev=0))
    return [r["prompt"] for r in arithmetic.generate(**cfg)["prompts"]][:n]


def hf_batch_sampler(model, tok, prompts, sampling, batch_size: int) -> list[list[int]]:
    """HF's own sampler over the same left-padded, length-sorted batches (what `generate` did before per-prompt
    seeds): the reference for the per-row sampler's cost."""
    import torch

    from stages.data.tokenize import render_prompt
    from stages.generation.common import eos_token_ids, trim_at_eos
    from stages.utils import pad

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


def main() -> None:
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
    ap.add_argument("--quick", action="store_true", help="1 repeat, no greedy check")
    ap.add_argument("--write", action="store_true", help="write benchmarks/RESULTS-generation.md")
    args = ap.parse_args()

    import torch

    from stages.generation import SamplingParams, generate

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        path, model, tok = build_model(args, Path(tmp))
        prompts = task_prompts(args.prompts)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.samples, do_sample=True, seed=0)
        variants = {"batched": args.batch_size, "one prompt at a time": 1, HF_SAMPLER: args.batch_size,
                    HF_GENERATE: args.batch_size}
        for bs in variants.values():  # warm-up: allocator, kernels, first-call overheads
            generate(model, tok, prompts[:2], sampling, batch_size=bs)
        best: dict[str, tuple[float, int, float]] = {}
        for _ in range(repeats):
            for name, bs in variants.items():
                if name == HF_SAMPLER:
                    comps, secs = timed(lambda: hf_batch_sampler(model, tok, prompts, sampling, bs))
                    finished = sum(bool(c) and c[-1] in (tok.eos_token_id,) for c in comps) / len(comps)
                elif name == HF_GENERATE:
                    gens, secs = timed(lambda: hf_generate_only(lambda: generate(model, tok, prompts, sampling,
                                                                                 batch_size=bs)))
                    comps, finished = gens.completion_ids, sum(gens.finished) / len(gens)
                else:
                    gens, secs = timed(lambda: generate(model, tok, prompts, sampling, batch_size=bs))
                    comps, finished = gens.completion_ids, sum(gens.finished) / len(gens)
                tokens = sum(map(len, comps))
                if name not in best or secs < best[name][0]:
                    best[name] = (secs, tokens, finished)
        same_greedy = None
        if not args.quick:
            greedy, check = SamplingParams(max_new_tokens=args.max_new_tokens), prompts[:32]
            batched = generate(model, tok, check, greedy, batch_size=args.batch_size).completion_ids
            single = [generate(model, tok, [p], greedy).completion_ids[0] for p in check]
            same_greedy = batched == single

    rows = []
    for name, (secs, tokens, finished) in best.items():
        rows.append((name, variants[name], secs, tokens, tokens / secs, finished))
        print(f"{name:>22}: batch_size={variants[name]:>3}  {secs:7.2f} s  {tokens:6d} tokens  "
              f"{tokens / secs:9.0f} tokens/s  finished {finished:.0%}")
    speedup = rows[0][4] / rows[1][4]
    print(f"speed-up batched / one at a time: {speedup:.1f}x (target >= 5x) -> {'MET' if speedup >= 5 else 'NOT MET'}")
    print(f"per-prompt seeded sampler / HF's batch sampler, tokens/s: {rows[0][4] / rows[2][4]:.2f}")
    print(f"with the decoder / HF's generate, tokens/s: {rows[0][4] / rows[3][4]:.2f}")
    if same_greedy is not None:
        print(f"greedy tokens identical batched vs one at a time (32 prompts): {same_greedy}")
    if args.write:
        write_results(args, path, rows, speedup, same_greedy, repeats)


def write_results(args, path, rows, speedup, same_greedy, repeats) -> None:
    import torch

    model_desc = (f"`{args.model}`" if args.model else
                  f"built-in tiny Llama (hidden {args.hidden_size}, {args.num_layers} layers, vocab 384)")
    lines = [
        "# stages.generation benchmark (HF backend)",
        "",
        "Command (from the repository root):",
        "",
        "```",
        f"OMP_NUM_THREADS={args.threads} python benchmarks/generation.py --write"
        + (f" --repeats {args.repeats}" if args.repeats != 2 else "")
        + (f" --model {args.model}" if args.model else ""),
        "```",
        "",
        f"Machine: {os.cpu_count()} vCPUs ({platform.processor() or platform.machine()}), device {args.device}, "
        f"torch {torch.__version__} with {args.threads} thread(s). The machine is shared with other jobs, so "
        "absolute figures are noisy; the variants ran round-robin in one process and each figure is the best "
        f"of {repeats} round(s).",
        "",
        f"Workload: {args.prompts} built-in task prompts x {args.samples} samples (do_sample, temperature 1), "
        f"max_new_tokens {args.max_new_tokens}, model: {model_desc}.",
        "",
        "| variant | prompts per generate call | wall s | generated tokens | tokens/s | finished (EOS) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, bs, secs, tokens, tps, finished in rows:
        lines.append(f"| {name} | {bs} | {secs:.2f} | {tokens} | {tps:.0f} | {finished:.0%} |")
    lines += [
        "",
        f"Speed-up batched / one prompt at a time: **{speedup:.1f}x** (target >= 5x: "
        f"{'met' if speedup >= 5 else 'NOT met'}).",
        f"Per-prompt seeded rows (`stages.generation.row_sampling`) / HF's batch sampler on the same batches: "
        f"**{rows[0][4] / rows[2][4]:.2f}x** the tokens/s.",
        f"The \"hf\" backend's decoder (`stages.generation.decoder`) / the same calls through HF's `generate`: "
        f"**{rows[0][4] / rows[3][4]:.2f}x** the tokens/s.",
    ]
    if same_greedy is not None:
        lines.append(f"Greedy decoding gives identical tokens batched and one at a time (first 32 prompts): "
                     f"{same_greedy}.")
    lines += [
        "",
        "## How to read it",
        "",
        "One prompt per call runs `max_new_tokens` sequential decoder steps per prompt, each a tiny matrix "
        "product dominated by Python and kernel-launch overhead; batching runs the same number of steps for "
        f"{args.batch_size} prompts x {args.samples} samples at once, so the overhead is shared. A fresh "
        "model rarely emits EOS, so nearly every completion runs to max_new_tokens and both variants generate "
        "about the same number of tokens; with a trained model (`--model`), sequences stop at different "
        "times and a batch keeps stepping until its longest member is done, which should lower the batched gain "
        "somewhat (not measured here; prompts are sorted by length first to keep left padding small).",
        "",
        "The baseline already generates each prompt's samples together (one `generate` call per prompt with "
        "`num_return_sequences`); one call per *sequence* would be slower still. The batched variant is "
        "compute-bound on one CPU thread: under cProfile its time goes to the linear layers, attention and "
        "the KV-cache concatenation, and batch sizes 64, 128 and 256 took the same time (7.4 s each, one "
        "measurement while developing); a preallocated static cache gave no gain on CPU. So the ratio moves "
        "with the background load on the shared cores (a 32-prompt smoke run measured 6.5x), and should "
        "grow with more threads or on a GPU (not measured here), where the batched forward costs little and "
        "per-step overhead dominates.",
        "",
    ]
    (REPO / "benchmarks" / "RESULTS-generation.md").write_text("\n".join(lines))
    print("wrote benchmarks/RESULTS-generation.md")


if __name__ == "__main__":
    main()
