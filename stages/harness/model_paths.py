"""Where a stage finds its model: `resolve_model` turns `model.name_or_path` into what `from_pretrained` takes.

`builtin:tiny` is built once per config into `<run.output_dir>/builtin/` (atomically, under a lock,
keyed by the hash of its config and code) and reused by every stage and concurrent run. A GGUF file
(a `.gguf` path, a folder with `model.gguf_file`, or `builtin:smollm2-135m-instruct`) is dequantised
the same way, once per file content, into `<run.output_dir>/builtin/gguf-<hash>/`. A local folder or
hub id is checked by `stages.models.local_or_hub`. `model_fingerprint` is the model's identity in lineage.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages import gguf
from stages.builtin import BUILTIN_MODELS
from stages.harness import artifacts
from stages.models import local_or_hub

if TYPE_CHECKING:  # annotations only: loading the params schema would load every method config
    from stages.harness.config import ModelConfig


def resolve_model(cfg: ModelConfig, output_dir: str | Path) -> str:
    """A path or hub id for `from_pretrained`; builds `builtin:tiny` or dequantises a GGUF file on first use."""
    name = cfg.name_or_path
    if name.startswith("builtin:") and name not in BUILTIN_MODELS:
        raise ValueError(f"model.name_or_path = {name!r}: unknown built-in model; built-ins: "
                         f"{', '.join(BUILTIN_MODELS)}")
    if name == "builtin:tiny":
        return str(_build_tiny(cfg, Path(output_dir)))
    if (file := gguf.gguf_file(name, cfg.gguf_file)) is not None:
        return str(_dequantised(file, Path(output_dir)))
    return local_or_hub(name)


def source_problem(cfg: ModelConfig, output_dir: str | Path) -> str | None:
    """Why `model.name_or_path` (not builtin:tiny) cannot be loaded, or None; checked before any training. A GGUF
    file whose folder is already built is not read again."""
    from stages.model_source import model_source_problem

    try:
        file = gguf.gguf_file(cfg.name_or_path, cfg.gguf_file)
    except FileNotFoundError:
        from stages.builtin import smollm2

        return smollm2.MISSING
    if file is None:
        return model_source_problem(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    if file.is_file() and artifacts.verify(_gguf_folder(file, Path(output_dir)))[0]:
        return None
    return gguf.gguf_problem(file)


def model_fingerprint(cfg: ModelConfig, output_dir: str | Path) -> str:
    """Lineage: a content hash for local/built-in models, the id for hub models."""
    path = Path(resolve_model(cfg, output_dir))
    if path.is_dir():
        return artifacts.tree_hash(artifacts.file_hashes(path))
    return f"hub:{cfg.name_or_path}"


def _gguf_folder(file: Path, output_dir: Path) -> Path:
    """Where GGUF `file` (an existing file) is dequantised: named by its content hash."""
    digest = artifacts.input_hash(file)  # memoised per (path, size, mtime): status and every stage ask
    if digest is None:
        raise FileNotFoundError(f"model.name_or_path: GGUF file {file} is gone")
    return output_dir / "builtin" / f"gguf-{digest[:12]}"


def _dequantised(file: Path, output_dir: Path) -> Path:
    """The plain model folder of GGUF `file`, dequantised on first use (keyed by the file's content)."""
    if not file.is_file():
        raise FileNotFoundError(f"model.name_or_path = {str(file)!r}: {gguf.gguf_problem(file)}")
    final = _gguf_folder(file, output_dir)
    if not artifacts.verify(final)[0] and (problem := gguf.gguf_problem(file)):
        raise ValueError(f"model.name_or_path = {str(file)!r}: {problem}")
    return _built_once(final, lambda tmp: gguf.dequantise(file, tmp),
                       {"builtin": "gguf", "file": file.name, "sha256": artifacts.input_hash(file)})


def _build_tiny(cfg: ModelConfig, output_dir: Path) -> Path:
    from stages.builtin import tiny

    spec = dataclasses.asdict(cfg.builtin)
    key = artifacts.hash_json({"spec": spec, "code": artifacts.code_hash(("stages/builtin",))})[:12]
    final = output_dir / "builtin" / f"tiny-{key}"
    return _built_once(final, lambda tmp: tiny.build(tmp, **spec), {"builtin": "tiny", "config": spec})


def _built_once(final: Path, build: Callable[[Path], object], manifest: dict[str, Any]) -> Path:
    """`final`, built by `build(folder)` unless it is there and verifies: atomically, sealed with `manifest`, and
    once under a lock, since concurrent runs sharing run.output_dir ask for it together."""
    if artifacts.verify(final)[0]:
        return final
    with artifacts.lock(final):
        if not artifacts.verify(final)[0]:
            artifacts.clean_leftovers(final)
            with artifacts.atomic_output(final) as tmp:
                build(tmp)
                artifacts.write_manifest(tmp, manifest)
    return final
