"""GPU check: a ~0.5B-parameter model of a real architecture through SFT -> DPO and GRPO, bf16 + LoRA
(+ QLoRA when bitsandbytes is importable), with this project's own trainers; one command:

    python -m benchmarks gpu_check                      # every mode, 8 optimizer steps per stage
    python -m benchmarks gpu_check --modes lora --steps 4 --json /tmp/gpu_check.json
    python -m benchmarks gpu_check --tiny               # a 2-layer model on CPU: the code path, in seconds

The model is Qwen2-0.5B's architecture (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151,936,
tied embeddings; 494M parameters) with random weights, built locally (no hub), with the built-in
tokenizer (stages.builtin.tiny) and the built-in arithmetic task. For each mode it prints, per
stage: peak GPU memory (torch.cuda.max_memory_allocated, the weights included), tokens/s (SFT and
DPO: non-padding input tokens the Trainer counted per second of training; GRPO: the trainer's own
`timing/tokens_per_s`, prompt and completion tokens over generation, scoring and training), and the DPO
margin of the first logged step (0 within bf16 noise: the policy starts equal to its reference,
the same weights with the adapter off).

DPO starts from the SFT adapter merged into the base (LoRA); under QLoRA it starts from the base,
quantized again (a 4-bit base cannot take a merge). Exit 77 (skipped) with a message when no CUDA
GPU is visible; `pytest -m gpu tests/benchmarks/test_gpu_check.py` runs it on a GPU machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import skip

MODES = ("lora", "qlora")
QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6,
                  tie_word_embeddings=True)
SMALL = dict(QWEN2_0_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # --small: the same code on CPU in seconds (a dry run)


def build_model(folder: Path, sizes: dict, device: str) -> int:
    """Write the random-init Qwen2 model (bf16) and the built-in tokenizer to `folder`; return its parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from stages.builtin import tiny

    tok = tiny.build_tokenizer(384)
    config = Qwen2Config(**sizes, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    count = sum(p.numel() for p in model.parameters())
    del model
    return count


def task_rows(n: int) -> dict[str, list]:
    from stages.builtin import arithmetic
    from stages.harness.config import ArithmeticConfig

    cfg = ArithmeticConfig(num_train=n, num_preference=n, num_eval=4, num_dev=0)
    return arithmetic.generate(**dataclasses.asdict(cfg))


def load(path: str, quantized: bool, device: str):
    """The model a stage trains: bf16 base (4-bit for QLoRA) with fresh LoRA adapters on every linear layer."""
    from stages.harness.config import LoraParams
    from stages.models import load_causal_lm
    from stages.trainers.adapters import apply_lora, quantization_config

    lora = LoraParams(enabled=True, r=16, alpha=32, dropout=0.0, quantization="4bit" if quantized else "none")
    model = load_causal_lm(path, dtype="bfloat16", device=device,
                           quantization_config=quantization_config(lora, device=device))
    return apply_lora(model, lora)


def args(out: Path, name: str, steps: int, batch: int, device: str) -> dict:
    return dict(use_cpu=device == "cpu", output_dir=str(out / name), max_steps=steps,
                per_device_train_batch_size=batch, learning_rate=1e-4, bf16=True, logging_steps=1, save_strategy="no",
                report_to="none", disable_tqdm=True, seed=0, include_num_input_tokens_seen="non_padding",
                dataloader_num_workers=0, warmup_steps=0)


def measured(trainer) -> dict:
    """Train; {"seconds", "peak_gib", "logs"} (peak since the last reset, weights included)."""
    import torch

    cuda = torch.cuda.is_available()
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the table at the end says it all
    start = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0,
            "logs": [h for h in trainer.state.log_history if "loss" in h]}


def fresh() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_mode(mode: str, base: str, out: Path, rows: dict, steps: int, device: str) -> list[dict]:
    from transformers import AutoTokenizer

    from stages.data.formats import normalise
    from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
    from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer
    from stages.trainers.sft_trainer import SFTConfig, SFTTrainer

    quantized, tok, results = mode == "qlora", AutoTokenizer.from_pretrained(base), []

    fresh()
    model = load(base, quantized, device)
    trainer = SFTTrainer(model, SFTConfig(**args(out, f"{mode}-sft", steps, 16, device), max_seq_length=256),
                         processing_class=tok, train_dataset=[normalise("messages", r) for r in rows["sft"]])
    got = measured(trainer)
    results.append({"mode": mode, "stage": "sft", **got,
                    "tokens_per_s": trainer.state.num_input_tokens_seen / got["seconds"]})
    dpo_base = base
    if not quantized:  # DPO starts from the SFT model: the adapter merged in
        dpo_base = str(out / f"{mode}-sft-merged")
        model.merge_and_unload().save_pretrained(dpo_base)
        tok.save_pretrained(dpo_base)
    del model, trainer

    fresh()
    pairs = [normalise("preference", r) for r in rows["preference"]]
    trainer = DPOTrainer(load(dpo_base, quantized, device), args=DPOConfig(
        **args(out, f"{mode}-dpo", steps, 8, device), beta=0.1),
                         processing_class=tok, train_dataset=pairs)
    got = measured(trainer)
    results.append({"mode": mode, "stage": "dpo", **got, "tokens_per_s": trainer.state.num_input_tokens_seen
                    / got["seconds"], "step0_margin": got["logs"][0].get("rewards/margins")})
    del trainer

    fresh()
    grpo = GRPOConfig(**{**args(out, f"{mode}-grpo", steps, 16, device), "include_num_input_tokens_seen": "no"},
                      num_generations=4, beta=0.04, max_completion_length=32)
    trainer = GRPOTrainer(load(dpo_base, quantized, device), ["exact_match"], args=grpo, processing_class=tok,
                          train_dataset=rows["prompts"])
    got = measured(trainer)
    speeds = [h["timing/tokens_per_s"] for h in got["logs"] if "timing/tokens_per_s" in h]
    results.append({"mode": mode, "stage": "grpo", **got, "tokens_per_s": sum(speeds) / max(len(speeds), 1)})
    del trainer
    fresh()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per stage")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--small", action="store_true", help="a 2-layer, hidden-64 Qwen2 instead (a dry run of the code)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (with --small: checks the code without a GPU)")
    ap.add_argument("--tiny", action="store_true", help="--small --cpu --steps 2: the code path on CPU in seconds")
    a = ap.parse_args(argv)
    if a.tiny:
        a.small, a.cpu, a.steps = True, True, 2
    modes = [m for m in a.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")

    import torch

    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return skip("gpu_check", "no CUDA GPU is visible (torch.cuda.is_available() is False); "
                    "run it on a machine with an NVIDIA GPU, or --tiny for the code path on CPU")
    if "qlora" in modes and (device == "cpu" or importlib.util.find_spec("bitsandbytes") is None):
        print("gpu_check: qlora skipped: " + ("QLoRA needs CUDA" if device == "cpu" else
                                              "bitsandbytes is not importable (pip install bitsandbytes)"))
        modes.remove("qlora")
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp)
        count = build_model(out / "base", SMALL if a.small else QWEN2_0_5B, device)
        where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        print(f"gpu_check: {where}, Qwen2 architecture, {count / 1e6:.0f}M parameters, "
              f"random init; {a.steps} steps per stage")
        rows = task_rows(max(64, a.steps * 16))
        for mode in modes:
            results += run_mode(mode, str(out / "base"), out, rows, a.steps, device)
    print(f"{'mode':6} {'stage':5} {'peak GiB':>8} {'tokens/s':>9} {'seconds':>8}  step-0 DPO margin")
    for r in results:
        margin = f"{r['step0_margin']:+.2e}" if r.get("step0_margin") is not None else ""
        print(f"{r['mode']:6} {r['stage']:5} {r['peak_gib']:8.2f} {r['tokens_per_s']:9.0f} {r['seconds']:8.1f}  "
              f"{margin}")
    if a.json:
        a.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "logs"} for r in results], indent=1))
    return 0

