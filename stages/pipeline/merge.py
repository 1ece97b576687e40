"""Stage `merge`: one full model to serve, from the policy stage's model and any extra adapters.

The input is the policy stage's `model/` (the SFT stage's with `policy.method: none`):
- a LoRA adapter: merged into the model it was trained on (the SFT model; itself merged
  first when SFT trained an adapter), with `merge.adapters` combined in by
  `merge.combination` and `merge.weights`, optionally pruned (`merge.prune_fraction`);
- a full model and no extra adapters: nothing to merge; it is re-saved as safetensors
  (anything that is not the causal LM, e.g. PPO's value_head.safetensors, is left behind).

The merge runs in float32 and is cast to `merge.dtype` (default `model.dtype`). After it the
merged model's logits on a probe batch (the first `merge.probe_size` eval prompts with
their references) must match the adapter model's within `merge.tolerance`; the max
difference and the lineage (base and adapters with hashes and weights, method, dtype,
output hash) go into the manifest. Writes `model/` (safetensors, tokenizer, chat template:
`AutoModelForCausalLM.from_pretrained` and vLLM load it) and `lineage.json` (paths inside
run.output_dir relative to it, e.g. `policy/model`).

    python -m stages merge [--set merge.adapters='[path/to/task-adapter]'] [--set merge.weights='[1.0, 0.5]']
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages import adapter_merge
from stages.data import read_jsonl
from stages.data.tokenize import render_prompt
from stages.harness import model_card
from stages.harness.model_paths import resolve_model
from stages.models import load_causal_lm, load_tokenizer, pick_device


def run(ctx) -> dict[str, Any]:
    p, m = ctx.params, ctx.params.merge
    device = pick_device(p.run.device)
    dtype = m.dtype or p.model.dtype
    source, stage, base = model_source(ctx)
    specs = adapter_specs(source, m.adapters, m.weights)
    tokenizer = load_tokenizer(source, trust_remote_code=p.model.trust_remote_code)
    out = ctx.out / "model"

    if not specs:  # a full model and nothing to combine: re-save it
        ctx.log.info("merge: %s model %s is a full model; no merge needed, re-saved as safetensors", stage, source)
        model = load_causal_lm(source, dtype=dtype, device=device, trust_remote_code=p.model.trust_remote_code)
        report = {"method": "none", "combination": None, "adapters": 0, "prune": None, "logits_max_diff": 0.0,
                  "change_max_diff": 0.0, "dtype": dtype, "tolerance": m.tolerance}
        adapter_merge.save_merged(model, tokenizer, out)
        write_card(ctx, out, report, stage)
        lineage = adapter_merge.lineage(base=source, specs=[], report=report, output=out, base_record={"stage": stage})
    else:
        if not adapter_merge.is_adapter(source):
            base = source  # extra adapters on a fully trained policy model: it is their base
        adapter_merge.check_adapters(specs, base=base, combination=m.combination, density=m.density,
                             prune_fraction=m.prune_fraction, prune_method=m.prune_method)  # before any loading
        probe = adapter_merge.probe_batch(tokenizer, probe_texts(ctx, tokenizer, m.probe_size))
        ctx.log.info("merge: %d adapter(s) into %s (%s, weights %s)", len(specs), base, m.combination,
                     [s.weight for s in specs])
        model, report = adapter_merge.merge_adapters(
            base, specs, combination=m.combination, density=m.density, svd_rank=m.svd_rank,
            prune_fraction=m.prune_fraction, prune_method=m.prune_method, dtype=dtype, probe=probe,
            tolerance=m.tolerance, device=device, seed=p.run.seed, trust_remote_code=p.model.trust_remote_code)
        adapter_merge.save_merged(model, tokenizer, out)
        write_card(ctx, out, report, stage)
        lineage = adapter_merge.lineage(base=base, specs=specs, report=report, output=out,
                                base_record={"adapter": adapter_merge.is_adapter(base)})
        ctx.log.info("merge: logits max diff %.3g (merged vs adapter model, tolerance %g)",
                     report["logits_max_diff"], m.tolerance)
    lineage["base_model"] = {"name_or_path": p.model.name_or_path}
    lineage = relative_paths(lineage, Path(p.run.output_dir))
    (ctx.out / "lineage.json").write_text(json.dumps(lineage, indent=2))
    return {"merged": bool(specs), "source": stage, **{k: v for k, v in report.items() if k != "tolerance"},
            "lineage": lineage}


def write_card(ctx, out: Path, report: dict[str, Any], source: str) -> None:
    """The merged model's card (stages.harness.model_card), before the lineage hashes the folder: the eval table comes
    with promotion, after stage evaluate."""
    model_card.write_stage_card(ctx, out, extra={"merge_method": report["method"], "source": source})


def relative_paths(lineage: dict[str, Any], root: Path) -> dict[str, Any]:
    """Paths inside run.output_dir written relative to it (`policy/model`): the output must not depend on
    where run.output_dir is, or two runs of the same params in two folders would hash differently."""
    def rel(record: dict[str, Any]) -> dict[str, Any]:
        path = Path(record["path"]).resolve()
        if path.is_relative_to(root.resolve()):
            return {**record, "path": path.relative_to(root.resolve()).as_posix()}
        return record

    return {**lineage, "base": rel(lineage["base"]), "adapters": [rel(a) for a in lineage["adapters"]]}


def model_source(ctx) -> tuple[str, str, str]:
    """(the model to merge, the stage that made it, the model it was trained on)."""
    p = ctx.params
    policy = ctx.inputs["policy"] / "model"
    sft = ctx.inputs["sft"] / "model"
    if policy.is_dir():
        return str(policy), "policy", str(sft)
    return str(sft), "sft", resolve_model(p.model, p.run.output_dir)


def adapter_specs(source: str, extra: list[str], weights: list[float] | None) -> list[adapter_merge.AdapterSpec]:
    """The policy's adapter (if it is one) first, then merge.adapters; weights paired, count checked."""
    paths = ([source] if adapter_merge.is_adapter(source) else []) + list(extra)
    specs = adapter_merge.pair_weights(paths, weights)
    if paths and paths[0] == source:  # name the policy adapter by what it is, not by a params key
        specs[0] = adapter_merge.AdapterSpec(specs[0].path, specs[0].weight, "the policy stage's adapter")
        specs[1:] = [adapter_merge.AdapterSpec(s.path, s.weight, f"merge.adapters[{i}]")
                     for i, s in enumerate(specs[1:])]
    return specs


def probe_texts(ctx, tokenizer, n: int) -> list[str]:
    """The first `n` eval prompts rendered with the chat template, each followed by its reference if it has one."""
    rows = read_jsonl(ctx.inputs["preprocess"] / "eval.jsonl")[:n]
    texts = [render_prompt(tokenizer, r["prompt"], r.get("tools")) + _reference(r.get("completion")) for r in rows]
    return texts or ["The quick brown fox jumps over the lazy dog."]


def _reference(completion: Any) -> str:
    if isinstance(completion, list):  # chat messages: the last one is the reference answer
        return completion[-1]["content"] if completion else ""
    return completion or ""
