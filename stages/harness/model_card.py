"""Model cards: a README.md in every saved model folder, written with huggingface_hub's ModelCard.

The card's metadata (`ModelCardData`) holds base_model, datasets, library_name (peft for an
adapter folder, else transformers), pipeline_tag, tags and, where known, the eval results as
`model-index`; an `align` entry keeps the stage, the method and its key params, so a later step
(promotion) can re-render the card with the eval table. The body repeats them as tables, with the
lineage: every stage the model came from, with its fingerprint and outputs hash (read from the
upstream manifests, stages/harness/artifacts.py), and the data files' content hashes.

Saved model folders are hashed into manifests, so a card holds no timestamps, no absolute paths
and no tracker run names: the same params, code and inputs give a byte-identical card. A stage's
own fingerprint is in manifest.json beside its folder, not in its card: a rebuild that
reproduces the weights (e.g. after a comment changed in its code) reproduces the card too.

Written by: training.save_outputs (sft, reward, policy), stages/pipeline/merge.py (merged) and
stages/pipeline/promote.py (the promoted model, with the evaluate row and lineage.json).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

CARD = "README.md"
TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ summary }}

## Method

{{ method_table }}
{% if eval_table %}
## Evaluation

{{ eval_table }}
{% endif %}
## Data

{{ data_table }}

## Lineage

{{ lineage_table }}

## Use

```python
{{ usage }}
```
"""
# the training knobs a card lists for every training stage (the method's own section is listed whole)
KEY_PARAMS = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
              "gradient_accumulation_steps", "lr_scheduler_type", "mixed_precision", "max_length", "max_seq_length",
              "loss_type", "lora.enabled", "lora.r", "lora.alpha", "lora.quantization")
SUMMARY = {
    "sft": "Supervised fine-tuning of the base model on demonstrations.",
    "reward": "A reward model (sequence classifier) trained on preference pairs, from the SFT model.",
    "policy": "The policy, optimised from the SFT model with {method}.",
    "merge": "The {source} stage's model ({method}) as one full model to serve (merge method: {merge_method}).",
    "promoted": "The merged model, promoted to production as release {version} after evaluation.",
}


def last_eval(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """The last logged value of every eval_* metric (the stage's final evaluation), runtimes left out."""
    out: dict[str, float] = {}
    for entry in log_history:
        out.update({k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))
                    and not k.endswith(("_runtime", "_per_second"))})
    return out


def write_stage_card(ctx, folder: Path, *, eval_metrics: dict[str, float] | None = None,
                     extra: dict[str, Any] | None = None) -> Path:
    """The card of stage `ctx.stage`'s model in `folder` (sft, reward, policy, merge)."""
    params, stage = ctx.params, ctx.stage
    knobs = key_params(dataclasses.asdict(getattr(params, stage)), stage)  # this section only: what the stage reads
    method = params.policy.method if stage == "policy" else stage
    if stage == "merge":  # the method that trained the merged model: the policy's (or SFT's), from its manifest
        policy = (_manifest(params, "policy").get("params") or {}).get("policy") or {}
        method = policy.get("method") if policy.get("method") not in (None, "none") else "sft"
        knobs = {**(key_params(policy, "policy") if method != "sft" else {}), **knobs}
    align = {"stage": stage, "method": method, "params": knobs, "lineage": lineage(ctx),
             "data": data_sources(params), **(extra or {})}
    results = [{"split": "validation", "metric": k.removeprefix("eval_"), "value": v}
               for k, v in sorted((eval_metrics or {}).items())]
    return write(folder, base_model=base_model(params), align=align, results=results)


def write(folder: Path, *, base_model: str, align: dict[str, Any], results: list[dict[str, Any]]) -> Path:
    """Render and save the card of `folder` from its `align` record and eval `results`
    ([{"split", "metric", "value"}])."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    stage, method = align["stage"], align["method"]
    library, tag = library_name(folder), pipeline_tag(folder)
    name = f"align-{stage}" if stage == method else f"align-{stage}-{method}"
    evals = [EvalResult(task_type=tag, dataset_type="align-eval", dataset_name=f"align {r['split']} split",
                        dataset_split=r["split"], metric_type=r["metric"], metric_name=r["metric"],
                        metric_value=r["value"]) for r in results if isinstance(r["value"], (int, float))]
    tags = ["align", stage, *([method] if method != stage else []), *(["lora"] if library == "peft" else [])]
    data = ModelCardData(base_model=base_model, datasets=sorted(align["data"].values()) or None,
                         library_name=library, pipeline_tag=tag, tags=tags, model_name=name,
                         eval_results=evals or None, align=align)
    card = ModelCard.from_template(
        data, template_str=TEMPLATE, model_name=name,
        summary=SUMMARY.get(stage, "A model of the align pipeline.").format(**align),
        method_table=table(["param", "value"], [["stage", stage], ["method", method],
                                               *([f"`{k}`", _cell(v)] for k, v in align["params"].items())]),
        eval_table=table(["split", "metric", "value"], [[r["split"], r["metric"], _cell(r["value"])]
                                                        for r in results]) if results else "",
        data_table=table(["params key", "source (id, or file and content hash)"],
                         [[k, v] for k, v in align["data"].items()]),
        lineage_table=table(["stage", "fingerprint", "outputs hash"],
                            [[s, f"`{r['fingerprint'][:16]}`", f"`{r['outputs_hash'][:16]}`"]
                             for s, r in align["lineage"].items()]),
        usage=usage(library, tag))
    path = Path(folder) / CARD
    card.save(path)
    return path


def promoted(folder: Path, *, row: dict[str, Any], lineage_record: dict[str, Any] | None, version: str,
             stages: dict[str, dict[str, str]] | None = None) -> Path:
    """Rewrite the card of a promoted copy in `folder`: the merged model's card (if it has one) with the
    evaluate table's row as its eval results, `stages` ({stage: {"fingerprint", "outputs_hash"}}: merge and
    evaluate) added to its lineage, and its lineage.json (the merge lineage) beside it."""
    from huggingface_hub import ModelCard

    old = Path(folder) / CARD
    meta = ModelCard.load(old).data.to_dict() if old.is_file() else {}
    align = dict(meta.get("align") or {"stage": "merge", "method": "unknown", "params": {}, "lineage": {},
                                       "data": {}})
    align.update(stage="promoted", version=version, lineage={**align.get("lineage", {}), **(stages or {})})
    split = row.get("split", "eval")
    results = [{"split": split, "metric": k, "value": v} for k, v in row.items()  # n: the row count, no metric
               if k not in ("model", "split", "n") and isinstance(v, (int, float)) and not isinstance(v, bool)]
    if lineage_record is not None:
        (Path(folder) / "lineage.json").write_text(json.dumps(lineage_record, indent=2))
    return write(folder, base_model=meta.get("base_model") or "unknown", align=align, results=results)


# --------------------------------------------------------------------------- what goes in


def lineage(ctx) -> dict[str, dict[str, str]]:
    """{stage: {"fingerprint", "outputs_hash"}} of every stage upstream of ctx.stage (the transitive closure
    of the upstream manifests' inputs), upstream stages first."""
    found: dict[str, dict[str, str]] = {}

    def visit(name: str) -> None:
        if name in found:
            return
        manifest = _manifest(ctx.params, name)
        for up in manifest.get("inputs") or {}:
            visit(up)
        found[name] = {"fingerprint": manifest.get("fingerprint", ""),
                       "outputs_hash": (manifest.get("outputs") or {}).get("hash", "")}

    for name in ctx.inputs:
        visit(name)
    return found


def data_sources(params) -> dict[str, str]:
    """{data params key: its source}, as stage preprocess recorded them in its manifest: an id as given
    (builtin:..., a hub id), a local file or folder as its name and content hash (never an absolute path)."""
    manifest = _manifest(params, "preprocess")
    data, files = (manifest.get("params") or {}).get("data") or {}, manifest.get("files") or {}
    out = {}
    for key, value in data.items():
        path = value.get("path") if isinstance(value, dict) else value
        digest = files.get(f"file:data.{key}")
        if digest and isinstance(path, str):
            out[f"data.{key}"] = f"{Path(path).name} (sha256:{digest[:16]})"
        elif isinstance(path, str) and (":" in path or "/" in path):  # builtin:..., org/name
            out[f"data.{key}"] = path
    return out


def base_model(params) -> str:
    """The base model as an id (model.name_or_path as stage preprocess recorded it): a hub id or builtin:... as
    given, a local folder by its name (no absolute path)."""
    name = ((_manifest(params, "preprocess").get("params") or {}).get("model") or {}).get("name_or_path") or "unknown"
    path = Path(name).expanduser()
    return path.name if path.exists() else name


def _manifest(params, stage: str) -> dict[str, Any]:
    """A stage's manifest in run.output_dir (stages.harness.runner.output_dir; not imported: this module sits below
    it)."""
    from stages.harness import artifacts

    return artifacts.read_manifest(Path(params.run.output_dir) / stage) or {}


def key_params(section: dict[str, Any], stage: str) -> dict[str, Any]:
    """The knobs of a stage's params `section` (as params.yaml nests it) a reader of the card wants: of a training
    section, KEY_PARAMS and the method's own keys (those TrainingArguments has not; the policy's: its method
    section's); merge's section whole. Unset (null) keys are left out."""
    from stages.trackers import flat
    from stages.trainers.arguments import TRAINING_ARGUMENT_NAMES

    if stage == "merge":
        return {f"merge.{k}": v for k, v in flat(section).items() if k != "adapters"}
    prefix, out = stage, {}
    if stage == "policy":
        method = section.get("method")
        chosen = section.get(method) if method is not None else None
        prefix, section, out = f"policy.{method}", chosen or {}, {"policy.method": method}
    for key, value in flat(section).items():
        if value is not None and (key in KEY_PARAMS or key.split(".")[0] not in TRAINING_ARGUMENT_NAMES):
            out[f"{prefix}.{key}"] = value
    return out


def library_name(folder: Path) -> str:
    return "peft" if (Path(folder) / "adapter_config.json").is_file() else "transformers"


def pipeline_tag(folder: Path) -> str:
    """text-classification for a reward model (sequence classifier, or a SEQ_CLS adapter), else text-generation."""
    folder = Path(folder)
    for name, key in (("adapter_config.json", "task_type"), ("config.json", "architectures")):
        if (folder / name).is_file():
            value = json.loads((folder / name).read_text()).get(key) or ""
            if "SEQ_CLS" in str(value) or "SequenceClassification" in str(value):
                return "text-classification"
    return "text-generation"


def usage(library: str, tag: str) -> str:
    if library == "peft":
        peft_cls = ("AutoPeftModelForSequenceClassification" if tag == "text-classification"
                    else "AutoPeftModelForCausalLM")
        return ("from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification\n"
                f"model = {peft_cls}"
                ".from_pretrained(\"path/to/this/folder\")")
    cls = "AutoModelForSequenceClassification" if tag == "text-classification" else "AutoModelForCausalLM"
    return (f"from transformers import AutoTokenizer, {cls}\n"
            f"model = {cls}.from_pretrained(\"path/to/this/folder\")\n"
            "tokenizer = AutoTokenizer.from_pretrained(\"path/to/this/folder\")")


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)
