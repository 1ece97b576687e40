"""Our code on a model sharded by torch's FSDP2 (`fully_shard`), beside the same model unsharded; each rank
writes what it measured to OUT/rank<N>.json for tests/distributed/test_sharded.py to judge.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/sharded_worker.py --model DIR --out DIR

Two shardings of the tiny Llama: "blocks" (each decoder layer, then the root: the head is in the root's
group, unsharded after the forward) and "head" (the head wrapped on its own too: resharded after the
forward, so reading it means gathering it). For each: which path `lm_head_for_chunking` picks with and
without gradients, the chunked log-probs (no grad: the gathered head) and their gradients (grad: the
logits fallback) against the unsharded model, greedy generation where rank 0 stops after 2 tokens and
rank 1 runs on (only lockstep forwards, `synced_gpus`, finish that), and the frozen reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # launched as a script
    sys.path.insert(0, str(ROOT))

from stages.builtin import arithmetic  # noqa: E402
from stages.data.formats import normalise  # noqa: E402
from stages.harness.config import ArithmeticConfig  # noqa: E402

SHARDINGS = ("blocks", "head")


def shard(model, how: str):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if how == "head":
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def pair_batch(tok, rank: int):
    from stages.trainers.pair_batches import PairCollator, tokenize_pairs

    cfg = ArithmeticConfig(num_train=8, num_preference=16, num_eval=4, num_dev=0)
    rows = [normalise("preference", r) for r in arithmetic.generate(**dataclasses.asdict(cfg))["preference"]]
    return PairCollator(tok.pad_token_id)(tokenize_pairs(tok, rows[2 * rank: 2 * rank + 2], 256))


def measure(how: str, model_path: str, rank: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation import SamplingParams
    from stages.generation.hf import generate
    from stages.logprobs import lm_head_for_chunking
    from stages.sharding import generate_kwargs, sharding_engine
    from stages.trainers.pair_batches import sequence_logps
    from stages.trainers.reference_model import frozen_reference
    from stages.trainers.rollout import completion_logps

    tok = AutoTokenizer.from_pretrained(model_path)
    plain = AutoModelForCausalLM.from_pretrained(model_path)
    sharded = shard(AutoModelForCausalLM.from_pretrained(model_path), how)
    got: dict = {"engine": sharding_engine(sharded), "plain_engine": sharding_engine(plain),
                 "head_is_dtensor": type(sharded.lm_head.weight).__name__ == "DTensor"}

    # no gradients: the head is read outside the forward, gathered
    batch = pair_batch(tok, rank)  # each rank its own rows
    with torch.no_grad():
        got["chunked_without_grad"] = lm_head_for_chunking(sharded) is not None
        want = sequence_logps(plain, batch, chunked=False)
        got["logps_nograd_diff"] = max_diff(sequence_logps(sharded, batch, chunked=True), want)
        got["head_is_dtensor_after_forward"] = type(sharded.lm_head.weight).__name__ == "DTensor"
        got["plain_chunked_diff"] = max_diff(sequence_logps(plain, batch, chunked=True), want)
        # the online methods' path (GRPO, PPO): every token's log-prob and entropy
        rollout = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                   "completion_mask": batch["attention_mask"][:, 1:]}
        want = completion_logps(plain, rollout, chunked=False, with_entropy=True)
        have = completion_logps(sharded, rollout, chunked=True, with_entropy=True)
        got["rollout_logps_diff"] = max(max_diff(have[k], want[k]) for k in ("logps", "entropy"))

    # gradients: the logits path; the same rows on both ranks, so the averaged gradient is this rank's
    got["chunked_with_grad"] = lm_head_for_chunking(sharded) is not None
    same = pair_batch(tok, 0)
    sequence_logps(plain, same, chunked=True).mean().backward()
    logps = sequence_logps(sharded, same, chunked=True)
    logps.mean().backward()
    got["logps_grad_diff"] = max_diff(logps, sequence_logps(plain, same, chunked=False))
    grads = dict(plain.named_parameters())
    got["grad_rel_diff"] = max(max_diff(full(p.grad), grads[n].grad) / grads[n].grad.abs().max().item()
                               for n, p in sharded.named_parameters())

    # generation: rank 0 stops after 2 tokens, rank 1 runs on to max_new_tokens
    prompts = [r["prompt"] for r in arithmetic.generate(**dataclasses.asdict(
        ArithmeticConfig(num_train=8, num_preference=8, num_eval=4, num_dev=0)))["prompts"][2 * rank: 2 * rank + 2]]
    sampling = SamplingParams(max_new_tokens=12)
    first = generate(plain, tok, prompts[:1], sampling).completion_ids[0]
    if rank == 0:  # an extra stop token: the second token of prompt 0's greedy completion
        for m in (plain, sharded):
            m.generation_config.eos_token_id = [tok.eos_token_id, first[1]]
    want_ids = generate(plain, tok, prompts, sampling).completion_ids
    got_ids = generate(sharded, tok, prompts, sampling).completion_ids
    got.update(generate_kwargs=generate_kwargs(sharded), plain_generate_kwargs=generate_kwargs(plain),
               generated_equal=got_ids == want_ids, generated_lengths=[len(c) for c in got_ids])

    # the frozen reference: loaded from the checkpoint and sharded, not copied from the shards
    ref = frozen_reference(sharded)
    with torch.no_grad():
        got["reference_logps_diff"] = max_diff(sequence_logps(ref, batch), sequence_logps(plain, batch))
    policy_storage = {p.to_local().data_ptr() if hasattr(p, "to_local") else p.data_ptr()
                      for p in sharded.parameters()}
    got["reference_sharded"] = sharding_engine(ref) == "fsdp2"
    got["reference_shares_storage"] = any((p.to_local() if hasattr(p, "to_local") else p).data_ptr()
                                          in policy_storage for p in ref.parameters())
    got["reference_frozen"] = not any(p.requires_grad for p in ref.parameters()) and not ref.training
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        result = {}
        for how in SHARDINGS:
            start = time.perf_counter()
            result[how] = {**measure(how, a.model, rank), "seconds": round(time.perf_counter() - start, 2)}
        (a.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
