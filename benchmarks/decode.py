"""Where a GRPO / online-DPO sampling call spends its time on CPU: HF `generate` of peers.py's model, 8 rows.

    OMP_NUM_THREADS=1 python benchmarks/decode.py              # ~1 minute
    OMP_NUM_THREADS=1 python benchmarks/decode.py --compile    # also torch.compile of the forward (~1 more)

The model and batch of `benchmarks/peers.py`'s GRPO step (hidden 256, 4 layers, vocabulary 1,024; 8 rows, a
12-token prompt, 32 new tokens, greedy with EOS disabled so every call decodes all 32). Prints, each the median
of `--calls` calls, best of `--rounds` alternated rounds:

- one decode forward (1 new token, KV cache) and the sum of its matmuls alone (every `nn.Linear` of the model
  applied to a (8, 1, in_features) input): how much of the forward is arithmetic;
- a generate call with transformers' default cache (`torch.cat` of the whole cache per step), with a
  preallocated cache written in place (`PreallocatedLayer` below, an experiment kept here, not in stages/),
  with `cache_implementation="static"`, and under one bf16 autocast region (as `precision.cached_casts`);
- with `--compile`: `torch.compile(model.forward, dynamic=True)`, the first call (compiling) and then steady;
- `stages.generation.decoder.Decoder`, the "hf" backend's fast path (its per-call weight copy included),
  at these 8 rows and at `--rows-large` rows (score's batch: 64 prompts x 4), against HF's generate there.

The outputs of the default cache, the preallocated cache and the decoder are checked to be the same token ids.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS, PROMPT, NEW = 8, 12, 32


def preallocated_cache(model, capacity: int):
    """transformers' DynamicCache for `model`, its full-attention layers writing into a buffer of `capacity`."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
                self.key_buffer, self.value_buffer = key_states.new_empty(shape), value_states.new_empty(shape)
            length, new = self.get_seq_length(), key_states.shape[-2]
            self.key_buffer[..., length:length + new, :] = key_states
            self.value_buffer[..., length:length + new, :] = value_states
            self.keys = self.key_buffer[..., :length + new, :]
            self.values = self.value_buffer[..., :length + new, :]
            return self.keys, self.values

    cache = DynamicCache(config=model.config)
    cache.layers[:] = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def median_time(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows-large", type=int, default=256)
    args = ap.parse_args(argv)
    import peers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(peers.build_model_dir("default")).eval()
    ids = torch.randint(5, 300, (ROWS, PROMPT))
    mask = torch.ones_like(ids)

    def generate(**kw):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0, eos_token_id=1, **kw)

    def bf16_generate():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate()

    def decode_forward():
        from transformers.cache_utils import DynamicCache

        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_mask = torch.cat([mask, torch.ones(ROWS, 1, dtype=mask.dtype)], 1)
            t0 = time.perf_counter()
            model(input_ids=ids[:, :1], attention_mask=step_mask, past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            return time.perf_counter() - t0

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(ROWS, 1, m.in_features) for m in linears]

    def matmuls():
        with torch.no_grad():
            for m, x in zip(linears, inputs):
                torch.nn.functional.linear(x, m.weight, m.bias)

    from stages.generation.decoder import Decoder

    large_ids = torch.randint(5, 300, (args.rows_large, PROMPT))
    large_mask = torch.ones_like(large_ids)

    def hf_large():
        with torch.no_grad():
            return model.generate(input_ids=large_ids, attention_mask=large_mask, max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=1)

    def decoder(ids=ids, mask=mask):  # EOS 1 never sampled here: the random model's argmax avoids it (checked)
        return Decoder(model).generate(ids, mask, NEW, [1], 0)

    same = torch.equal(generate(), generate(cache=preallocated_cache(model, PROMPT + NEW)))
    same_decoder = torch.equal(generate()[:, PROMPT:], decoder())
    cases = {
        "generate, default dynamic cache": generate,
        "generate, preallocated cache": lambda: generate(cache=preallocated_cache(model, PROMPT + NEW)),
        "generate, cache_implementation=static": lambda: generate(cache_implementation="static"),
        "generate, one bf16 autocast region": bf16_generate,
        "stages.generation.decoder": decoder,
        f"generate, {args.rows_large} rows": hf_large,
        f"stages.generation.decoder, {args.rows_large} rows": lambda: decoder(large_ids, large_mask),
    }
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        best["one decode forward"] = min(best.get("one decode forward", 1e9),
                                         statistics.median(decode_forward() for _ in range(args.calls * 4)))
        best[f"its {len(linears)} matmuls alone"] = min(best.get(f"its {len(linears)} matmuls alone", 1e9),
                                                        median_time(matmuls, args.calls * 4))
        for name, fn in cases.items():
            best[name] = min(best.get(name, 1e9), median_time(fn, args.calls))
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
        t0 = time.perf_counter()
        generate()
        best["generate, torch.compile: first call"] = time.perf_counter() - t0
        best["generate, torch.compile: steady"] = median_time(generate, args.calls)

    print(f"model: peers.py's Llama (hidden 256, 4 layers, vocab 1024); {ROWS} rows, {PROMPT}-token prompt, "
          f"{NEW} new tokens; torch {torch.__version__}, threads {torch.get_num_threads()}")
    base, large = best["generate, default dynamic cache"], best[f"generate, {args.rows_large} rows"]
    for name, seconds in best.items():
        against = large if name.endswith(f"{args.rows_large} rows") else base
        vs = f"  ({against / seconds:.2f}x generate's speed)" if name.startswith(("generate", "stages")) else ""
        print(f"{name:<48} {seconds * 1e3:9.2f} ms{vs}")
    print(f"preallocated cache gives the same token ids as the default: {same}")
    print(f"the decoder gives the same token ids as the default: {same_decoder}")


if __name__ == "__main__":
    main()
