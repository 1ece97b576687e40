"""Stage `reference`: the reference model's log-probs of every DPO pair, computed once and cached.

DPO compares the policy with a frozen reference (the SFT model) on every pair; that is a
second forward pass per step. With `policy.dpo.precompute_ref_log_probs` (default) this
stage runs the reference once over the pairs the policy will train on and writes them,
with the log-probs added, to `pairs.jsonl`. It computes them as the policy will run at step 0:
under `policy.dpo.mixed_precision` (the forward autocast, fp32 outputs, as the Trainer runs it) and,
with QLoRA (`policy.dpo.lora.quantization`), on the quantised base. Its fingerprint covers only what
the numbers depend on (the SFT model, the pairs, `max_length`, `ld_alpha`, dtype, precision, quantization), so
a rerun of `policy` with another `beta` or `loss_type` finds this stage current and runs no
reference forward at all.
For other methods, or with precompute off, it records that nothing was needed.

    python -m stages reference
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stages.data import write_jsonl
from stages.models import load_causal_lm, load_tokenizer, pick_device
from stages.pipeline.prompts import preference_pairs
from stages.precision import autocast_forward, mixed_precision
from stages.trainers.adapters import quantization_config
from stages.trainers.reference_model import compute_reference_logps

if TYPE_CHECKING:  # annotations only: a stage's code closure is what it runs
    from stages.harness.config import PolicyParams
    from stages.harness.runner import StageContext


def needed(pol: PolicyParams) -> str | None:
    """Why no reference pass is needed for these policy params (None: it is)."""
    if pol.method != "dpo":
        return f"policy.method = {pol.method}"
    if pol.dpo.reference_free:
        return "policy.dpo.reference_free = true"
    if not pol.dpo.precompute_ref_log_probs:
        return "policy.dpo.precompute_ref_log_probs = false (the reference runs live during training)"
    return None


def run(ctx: StageContext) -> dict[str, Any]:
    p, pol = ctx.params, ctx.params.policy
    why_not = needed(pol)
    if why_not:
        ctx.log.info("reference: nothing to precompute (%s)", why_not)
        return {"computed": False, "reason": why_not}
    source, pairs = preference_pairs(ctx, pol.data)
    device = pick_device(p.run.device)
    sft = str(ctx.inputs["sft"] / "model")
    tokenizer = load_tokenizer(sft, trust_remote_code=p.model.trust_remote_code)
    # the policy's numerics: its autocast and, for QLoRA, its quantised base (the reference is that base with
    # the adapter off); both refused here, before loading, where the policy could not run them either
    precision = mixed_precision(pol.dpo.mixed_precision, device, "policy.dpo")
    quantization = quantization_config(pol.dpo.lora, device=device, key="policy.dpo.lora.quantization")
    model = load_causal_lm(sft, dtype=p.model.dtype, device=device, trust_remote_code=p.model.trust_remote_code,
                           quantization_config=quantization)
    ctx.log.info("reference: log-probs of %d pairs from %s under %s (mixed precision %s, quantization %s)",
                 len(pairs), source, sft, precision, pol.dpo.lora.quantization if quantization else "none")
    with autocast_forward(model, precision):
        rows = compute_reference_logps(model, tokenizer, pairs, max_length=pol.dpo.max_length, batch_size=32,
                                       ld_alpha=pol.dpo.ld_alpha)
    write_jsonl(ctx.out / "pairs.jsonl", rows)
    return {"computed": True, "pairs": len(rows), "source": str(source.parent.name), "mixed_precision": precision,
            "quantization": pol.dpo.lora.quantization if quantization else "none"}
