"""CPU attention under bf16 autocast: torch's bf16 flash-attention backward against fp32, and a Llama step with
plain sdpa against our `CPU_FP32_SDPA` (stages.trainers.precision).

    OMP_NUM_THREADS=1 python benchmarks/attention.py

Prints ms per causal SDPA forward + backward of one (16, 4, 36, 64) call in fp32 and bf16, and s per bf16-autocast
training step (forward + backward) of a Llama with hidden 256, 4 layers, vocabulary 1,024 on 16 x 36 tokens
(the peers benchmark's model), with each attention implementation. One thread; medians of repeated calls.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stages.trainers.precision import use_fp32_cpu_attention  # noqa: E402

B, H, T, D = 16, 4, 36, 64


def median_time(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sdpa_call(dtype):
    x = torch.randn(B, T, H * D, dtype=dtype, requires_grad=True)

    def step():
        q = x.view(B, T, H, D).transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    return step


def llama_step(model, ids):
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        out.logits.float().mean().backward()
    return step


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        print(f"SDPA fwd+bwd {str(dtype):15s} {median_time(sdpa_call(dtype), 50) * 1e3:.2f} ms")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=768))
    ours = copy.deepcopy(plain)
    use_fp32_cpu_attention(ours)
    ids = torch.randint(0, 1024, (B, T))
    for round_ in range(2):  # alternated
        for name, model in (("sdpa", plain), ("sdpa_cpu_fp32", ours)):
            print(f"round {round_} bf16 Llama step, {name:14s} {median_time(llama_step(model, ids), 10):.3f} s")


if __name__ == "__main__":
    main()
