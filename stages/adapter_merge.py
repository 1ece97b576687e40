"""Merging LoRA adapters into a full model: one adapter, several weighted, or a chain; pruning; checks; lineage.

    model, report = merge_adapters("base-folder", [AdapterSpec("adapter-folder")], probe=probe_batch(tok, texts))

Combinations (`COMBINATIONS`): PEFT's `add_weighted_adapter` types (`linear`, `cat`, `ties`, `dare_linear`,
`dare_ties`, `svd`) over adapters trained on one base, and `sequential` (each adapter merged into the result of
the previous one). One adapter is always merged exactly: ΔW = w · s · B·A. Pruning (`PRUNE_METHODS`) applies
to the combined adapter before merging: `magnitude` zeroes the smallest entries of each ΔW, `rank` keeps its
top singular directions.

Every merge runs in float32 (upcast, merged, then cast to `dtype`) and is checked: the merged model's logits on
a probe batch must equal the adapter model's within `tolerance`. Every check that needs only the adapters'
config files (`check_adapters`) runs before any model is loaded.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.basics import file_hashes, tree_hash

COMBINATIONS = ("linear", "cat", "ties", "dare_linear", "dare_ties", "svd", "sequential")
NEEDS_DENSITY = ("ties", "dare_linear", "dare_ties")
SAME_RANK = ("linear", "ties", "dare_linear", "dare_ties")  # PEFT stacks A and B: the ranks must agree
PRUNE_METHODS = ("magnitude", "rank")
ADAPTER_CONFIG = "adapter_config.json"


class MergeError(ValueError):
    """Inputs that cannot be merged (found before any model is loaded where possible)."""


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter to merge.

    Attributes:
        path: a PEFT adapter folder (with adapter_config.json).
        weight: multiplies the adapter's update ΔW.
        label: how errors name it (e.g. the params key it came from).
    """

    path: str
    weight: float = 1.0
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.path


# --------------------------------------------------------------------------- config-only checks


def adapter_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's adapter_config.json, or None when it is not an adapter folder."""
    file = Path(path) / ADAPTER_CONFIG
    return json.loads(file.read_text()) if file.is_file() else None


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def model_identity(path_or_id: str | Path) -> str:
    """What a model *is*: the content hash of a local folder (so copies and relative paths agree), else the hub id."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return "sha256:" + tree_hash(file_hashes(path))[:16]
    return f"hub:{path_or_id}"


def pair_weights(paths: list[str], weights: list[float] | None, *, key: str = "merge") -> list[AdapterSpec]:
    """AdapterSpecs from paths and their weights (None: all 1.0); a count mismatch is an error."""
    if weights is None:
        weights = [1.0] * len(paths)
    if len(weights) != len(paths):
        raise MergeError(f"{key}.weights = {weights}: {len(weights)} weight(s) for {len(paths)} adapter(s) "
                         f"({', '.join(paths)}); give one weight per adapter, or null for all 1.0")
    return [AdapterSpec(str(p), float(w), f"{key}.adapters[{i}]")
            for i, (p, w) in enumerate(zip(paths, weights, strict=True))]


def check_adapters(specs: list[AdapterSpec], *, base: str | None = None, combination: str = "linear",
                   density: float | None = None, prune_fraction: float = 0.0, prune_method: str = "magnitude",
                   key: str = "merge") -> list[dict[str, Any]]:
    """Everything that can be checked from the adapters' config files, before a model is loaded.

    `base`: the model the adapters were trained on, when known better than their own record
    (`base_model_name_or_path` records the model that was *loaded*, not e.g. an SFT adapter
    merged into it); None: the first adapter's record. All adapters must share it, except
    in a `sequential` chain where each is trained on the previous result. Returns the configs.
    """
    problems = []
    if not specs:
        raise MergeError(f"{key}: no adapter to merge")
    if combination not in COMBINATIONS:
        problems.append(f"{key}.combination = {combination!r}: unknown; one of {', '.join(COMBINATIONS)}")
    if not (isinstance(prune_fraction, (int, float)) and 0 <= prune_fraction < 1):
        problems.append(f"{key}.prune_fraction = {prune_fraction!r}: must be in [0, 1) (the share of each "
                        "adapter update to drop; 0 = no pruning)")
    if prune_method not in PRUNE_METHODS:
        problems.append(f"{key}.prune_method = {prune_method!r}: unknown; one of {', '.join(PRUNE_METHODS)}")
    if combination in NEEDS_DENSITY and len(specs) > 1 and not (density is not None and 0 < density <= 1):
        problems.append(f"{key}.density = {density!r}: combination {combination} needs a density in (0, 1] "
                        "(the share of each update kept; 0.5 is typical)")
    configs = []
    for s in specs:
        if not math.isfinite(s.weight):
            problems.append(f"{s.name}: weight {s.weight} is not a finite number")
        cfg = adapter_config(s.path)
        if cfg is None:
            what = "no such folder" if not Path(s.path).exists() else f"no {ADAPTER_CONFIG} in it"
            problems.append(f"{s.name} = {s.path!r}: not a PEFT adapter folder ({what}); point it at a folder "
                            "written by PeftModel.save_pretrained")
        elif cfg.get("peft_type", "LORA") != "LORA":
            problems.append(f"{s.name}: a {cfg['peft_type']} adapter; only LoRA adapters can be merged here")
        elif prune_fraction > 0 and cfg.get("use_dora"):
            problems.append(f"{s.name}: a DoRA adapter; pruning is defined for plain LoRA updates only "
                            f"(set {key}.prune_fraction: 0)")
        configs.append(cfg)
    if problems:
        raise MergeError("cannot merge:\n  " + "\n  ".join(problems))

    if combination != "sequential":
        recorded = [base or configs[0].get("base_model_name_or_path")] + [c.get("base_model_name_or_path")
                                                                           for c in configs[1:]]
        ids = [model_identity(r) if r else None for r in recorded]
        for s, r, i in zip(specs[1:], recorded[1:], ids[1:], strict=True):
            if i != ids[0]:
                raise MergeError(f"adapters trained on different bases: {specs[0].name} on {recorded[0]!r} ({ids[0]}), "
                                 f"{s.name} on {r!r} ({i}); only adapters of one base can be combined (use "
                                 f"{key}.combination: sequential for adapters trained one on top of the other)")
    ranks = [max([c.get("r", 0), *(c.get("rank_pattern") or {}).values()]) for c in configs]
    if combination in SAME_RANK and len(specs) > 1 and len(set(ranks)) > 1:
        raise MergeError(f"{key}.combination = {combination}: needs adapters of one rank, got ranks "
                         f"{dict(zip([s.name for s in specs], ranks, strict=True))}; use cat or svd for mixed ranks")
    return configs


# --------------------------------------------------------------------------- probe and logits check


def probe_batch(tokenizer, texts: list[str], *, max_length: int = 128) -> dict[str, torch.Tensor]:
    """A fixed right-padded batch of `texts`: input_ids, attention_mask (N, T)."""
    enc = tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=max_length,
                    padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def probe_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 logits at the batch's real (unpadded) positions: (number of real tokens, V)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    finally:
        model.train(was_training)
    return out.logits.float()[batch["attention_mask"].to(device).bool()].cpu()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# --------------------------------------------------------------------------- the operations


def lora_layers(model, adapter: str):
    """(name, module) of every LoRA layer that holds `adapter`."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]


def scale_adapter(model, adapter: str, weight: float) -> None:
    """ΔW of `adapter` times `weight` in every layer (exact: the scaling factor s = alpha / r is multiplied)."""
    if weight != 1.0:
        for _, m in lora_layers(model, adapter):
            m.scaling[adapter] *= weight


def combine(model, names: list[str], weights: list[float], combination: str, *, density: float | None = None,
            svd_rank: int | None = None, seed: int = 0) -> str:
    """One active adapter from `names` with `weights` (PEFT's add_weighted_adapter); returns its name.

    A single adapter is only rescaled (exact; PEFT would refactor it into sqrt-scaled factors).
    """
    if len(names) == 1:
        scale_adapter(model, names[0], weights[0])
        model.set_adapter(names[0])
        return names[0]
    torch.manual_seed(seed)  # dare_* drops entries at random
    model.add_weighted_adapter(names, list(weights), "combined", combination_type=combination, density=density,
                               svd_rank=svd_rank)
    model.set_adapter("combined")
    return "combined"


@torch.no_grad()
def prune(model, adapter: str, fraction: float, method: str = "magnitude") -> dict[str, Any]:
    """Prune every LoRA update ΔW = s · B·A of `adapter` in place; returns what was removed, measured.

    magnitude: per layer, the `fraction` of ΔW's entries with the smallest |value| are
        zeroed. The result is no longer low-rank, so the pruned ΔW is added to the base
        weight (in float32) and the adapter's B is zeroed: merging then adds nothing more.
    rank: per layer, ΔW is replaced by its best rank-k approximation (truncated SVD),
        k = max(1, round((1 - fraction) · r)); A and B hold the k directions (padded with zeros).

    Returns: pruned_fraction (zeroed entries / all entries for magnitude, dropped rank / rank
    for rank), energy_removed (||ΔW - ΔW'||² / ||ΔW||², summed over layers), layers, method.
    """
    if not 0 <= fraction < 1:
        raise MergeError(f"prune fraction = {fraction}: must be in [0, 1)")
    if method not in PRUNE_METHODS:
        raise MergeError(f"prune method = {method!r}: unknown; one of {', '.join(PRUNE_METHODS)}")
    zeroed = total = 0
    removed = energy = 0.0
    rank_before = rank_after = 0
    layers = lora_layers(model, adapter)
    for _, m in layers:
        A, B = m.lora_A[adapter].weight, m.lora_B[adapter].weight  # (r, in), (out, r)
        s = m.scaling[adapter]
        if method == "magnitude":
            delta = m.get_delta_weight(adapter).float()  # in the base weight's layout
            k = int(round(fraction * delta.numel()))
            pruned = delta.clone().flatten()
            if k:
                pruned[pruned.abs().argsort()[:k]] = 0.0
            pruned = pruned.view_as(delta)
            base = m.get_base_layer().weight
            base.copy_((base.float() + pruned).to(base.dtype))
            B.zero_()
            zeroed += int((pruned == 0).sum()) - int((delta == 0).sum())
            total += delta.numel()
            removed += float((delta - pruned).pow(2).sum())
            energy += float(delta.pow(2).sum())
        else:
            delta = (B.float() @ A.float()) * s  # (out, in)
            r = A.shape[0]
            keep = max(1, round((1 - fraction) * r))
            U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
            low = (U[:, :keep] * S[:keep]) @ Vh[:keep]
            A.zero_()
            B.zero_()
            A[:keep] = Vh[:keep].to(A.dtype)
            B[:, :keep] = (U[:, :keep] * S[:keep] / s).to(B.dtype)
            rank_before += r
            rank_after += keep
            removed += float((delta - low).pow(2).sum())
            energy += float(delta.pow(2).sum())
    if method == "magnitude":
        measured = zeroed / total if total else 0.0
    else:
        measured = 1 - rank_after / rank_before if rank_before else 0.0
    return {"method": method, "fraction": fraction, "pruned_fraction": round(measured, 6),
            "energy_removed": round(removed / energy, 6) if energy else 0.0, "layers": len(layers),
            **({"rank_before": rank_before // max(len(layers), 1), "rank_after": rank_after // max(len(layers), 1)}
               if method == "rank" else {})}


def merge_and_unload(model, *, dtype: str = "float32", adapter_names: list[str] | None = None):
    """PEFT's merge_and_unload in float32 (upcast first), then cast to `dtype`: a plain transformers model."""
    model = model.float()
    merged = model.merge_and_unload(progressbar=False, safe_merge=True, adapter_names=adapter_names)
    return merged.to(getattr(torch, dtype))


def load_base(path: str, *, device: str = "cpu", trust_remote_code: bool = False):
    """The model adapters are merged into, in float32: a model folder or hub id, or an adapter folder
    (e.g. an SFT adapter) that is merged into its own base first."""
    from stages.models import load_causal_lm

    return load_causal_lm(path, dtype="float32", device=device, trust_remote_code=trust_remote_code)


def load_adapter_model(base: str, adapter: str, *, dtype: str = "float32", device: str = "cpu",
                       trust_remote_code: bool = False):
    """The unmerged adapter model: `adapter` on `base` (which may itself be an adapter folder, merged first).

    Unlike loading the adapter folder alone, this uses the base the pipeline knows, not the
    one the adapter recorded (a policy adapter trained on a merged SFT adapter records the raw base).
    """
    from peft import PeftModel

    model = load_base(base, device=device, trust_remote_code=trust_remote_code).to(getattr(torch, dtype))
    return PeftModel.from_pretrained(model, adapter).eval()


def merge_adapters(base: str, specs: list[AdapterSpec], *, combination: str = "linear", density: float | None = None,
                   svd_rank: int | None = None, prune_fraction: float = 0.0, prune_method: str = "magnitude",
                   dtype: str = "float32", probe: dict[str, torch.Tensor] | None = None, tolerance: float = 1e-4,
                   device: str = "cpu", seed: int = 0, trust_remote_code: bool = False, key: str = "merge"):
    """Merge `specs` into `base`; returns (merged model in `dtype`, report).

    Args:
        base: the model the adapters were trained on (folder, hub id, or an adapter folder merged first).
        specs: adapters with their weights; combined by `combination` (or chained: "sequential").
        probe: a `probe_batch`; without it no logits check is made.
        tolerance: the largest allowed |merged - adapter model| logit difference (float32 merge).

    Report: method, combination, prune (see `prune`), logits_max_diff (merged vs the adapter
    model just before merging; raises MergeError above `tolerance`), change_max_diff (merged
    vs the first adapter alone at weight 1: what combining and pruning changed), dtype.
    """
    from peft import PeftModel

    check_adapters(specs, base=base, combination=combination, density=density, prune_fraction=prune_fraction,
                   prune_method=prune_method, key=key)
    model = load_base(base, device=device, trust_remote_code=trust_remote_code)
    diffs, prune_report, reference = [], None, None
    chain = [[s] for s in specs] if combination == "sequential" else [specs]
    for step, group in enumerate(chain):
        names = [f"adapter_{step}_{i}" for i in range(len(group))]
        model = PeftModel.from_pretrained(model, group[0].path, adapter_name=names[0])
        for name, s in zip(names[1:], group[1:], strict=True):
            model.load_adapter(s.path, adapter_name=name)
        if probe is not None and step == 0:
            reference = probe_logits(model, probe)  # the first adapter alone, weight 1
        active = combine(model, names, [s.weight for s in group], "linear" if combination == "sequential"
                         else combination, density=density, svd_rank=svd_rank, seed=seed)
        if prune_fraction > 0 and step == len(chain) - 1:
            prune_report = prune(model, active, prune_fraction, prune_method)
        before = probe_logits(model, probe) if probe is not None else None
        model = merge_and_unload(model, dtype="float32", adapter_names=[active])
        if probe is not None:
            diffs.append(max_abs_diff(probe_logits(model, probe), before))
    logits_max_diff = max(diffs) if diffs else None
    if logits_max_diff is not None and logits_max_diff > tolerance:
        raise MergeError(f"merge check failed: the merged model's logits differ from the adapter model's by "
                         f"{logits_max_diff:.3g} > tolerance {tolerance:g} on the probe batch")
    change = max_abs_diff(probe_logits(model, probe), reference) if probe is not None else None
    model = model.to(getattr(torch, dtype))
    if probe is not None and dtype != "float32":
        cast_diff = max_abs_diff(probe_logits(model, probe), reference)
    else:
        cast_diff = None
    report = {"method": "sequential" if combination == "sequential" else "merge_and_unload",
              "combination": combination if len(specs) > 1 else "single", "adapters": len(specs),
              "prune": prune_report, "logits_max_diff": logits_max_diff, "change_max_diff": change,
              "cast_change_max_diff": cast_diff, "tolerance": tolerance, "dtype": dtype}
    return model, report


def lineage(*, base: str, specs: list[AdapterSpec], report: dict[str, Any], output: Path | None,
            base_record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a merged model came from: base (path, hash), each adapter (path, hash, weight, rank), method,
    dtype and the output's hash."""
    def adapter(s: AdapterSpec) -> dict[str, Any]:
        cfg = adapter_config(s.path) or {}
        return {"path": s.path, "label": s.label, "hash": model_identity(s.path), "weight": s.weight,
                "recorded_base": cfg.get("base_model_name_or_path"), "r": cfg.get("r"),
                "lora_alpha": cfg.get("lora_alpha")}

    return {
        "base": {"path": base, "hash": model_identity(base), **(base_record or {})},
        "adapters": [adapter(s) for s in specs],
        "method": report.get("method"), "combination": report.get("combination"), "prune": report.get("prune"),
        "dtype": report.get("dtype"),
        "output_hash": "sha256:" + tree_hash(file_hashes(output))[:16] if output else None,
    }


def save_merged(model, tokenizer, out: Path) -> None:
    """model.safetensors + config + generation config, tokenizer and chat template: a plain HF model folder."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
