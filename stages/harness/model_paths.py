"""Where a stage finds its model: `resolve_model` turns `model.name_or_path` into what `from_pretrained` takes.

`builtin:tiny` is built once per config into `<run.output_dir>/builtin/` (atomically, under a lock,
keyed by the hash of its config and code) and reused by every stage and concurrent run; a local
folder or hub id is checked by `stages.models.local_or_hub`. `model_fingerprint` is the model's
identity in lineage.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from stages.builtin import BUILTIN_MODELS
from stages.harness import artifacts
from stages.models import local_or_hub

if TYPE_CHECKING:  # annotations only: loading the params schema would load every method config
    from stages.harness.config import ModelConfig


def resolve_model(cfg: ModelConfig, output_dir: str | Path) -> str:
    """A path or hub id for `from_pretrained`; builds `builtin:tiny` on first use."""
    name = cfg.name_or_path
    if name.startswith("builtin:"):
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model.name_or_path = {name!r}: unknown built-in model; built-ins: "
                             f"{', '.join(BUILTIN_MODELS)}")
        return str(_build_tiny(cfg, Path(output_dir)))
    return local_or_hub(name)


def model_fingerprint(cfg: ModelConfig, output_dir: str | Path) -> str:
    """Lineage: a content hash for local/built-in models, the id for hub models."""
    path = Path(resolve_model(cfg, output_dir))
    if path.is_dir():
        return artifacts.tree_hash(artifacts.file_hashes(path))
    return f"hub:{cfg.name_or_path}"


def _build_tiny(cfg: ModelConfig, output_dir: Path) -> Path:
    from stages.builtin import tiny

    spec = dataclasses.asdict(cfg.builtin)
    key = artifacts.hash_json({"spec": spec, "code": artifacts.code_hash(("stages/builtin",))})[:12]
    final = output_dir / "builtin" / f"tiny-{key}"
    if artifacts.verify(final)[0]:
        return final
    with artifacts.lock(final):  # concurrent runs sharing run.output_dir build it once
        if not artifacts.verify(final)[0]:
            artifacts.clean_leftovers(final)
            with artifacts.atomic_output(final) as tmp:
                tiny.build(tmp, **spec)
                artifacts.write_manifest(tmp, {"builtin": "tiny", "config": spec})
    return final
