"""Run one stage under the stage contract.

`run_stage(name, params)` checks whether the stage's output folder is current (see
`stages.artifacts`); if not, it calls the stage's entry point with a `StageContext`
pointing at a temporary folder, then seals it with a manifest and renames it into place.
Every entry point goes through here: `python -m stages <stage>`, the Prefect tasks, `dvc repro`.
"""
from __future__ import annotations

import importlib
import logging
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from stages import artifacts
from stages.config import Params
from stages.registry import STAGES, StageSpec, get_stage

log = logging.getLogger("stages")

VERSIONED = ("torch", "transformers", "tokenizers", "peft", "accelerate", "datasets", "align")


class UpstreamMissing(RuntimeError):
    pass


class QualityGateFailed(RuntimeError):
    """A stage's output is not good enough to build on (e.g. a reward model below reward.min_accuracy)."""


@dataclass
class StageContext:
    """What a stage's `run` receives: its params, where to write, where its inputs are."""

    params: Params
    out: Path  # temporary folder; everything written here becomes the stage's output
    inputs: dict[str, Path]  # upstream stage name -> its (verified) output folder
    log: logging.Logger
    work: Path  # persists across crashed attempts of this fingerprint (checkpoints); removed on success


@dataclass
class StageState:
    name: str
    fingerprint: str
    folder: Path
    current: bool
    reason: str  # why it is not current ("" when current)
    upstream: dict[str, dict[str, Any]]  # upstream name -> its manifest


def output_dir(params: Params, name: str) -> Path:
    return Path(params.run.output_dir) / name


def metrics_path(params: Params, name: str) -> Path:
    return Path(params.run.output_dir) / "metrics" / f"{name}.json"


def inspect(name: str, params: Params) -> StageState:
    """Compute the stage's fingerprint from its params, code and upstream outputs; is its folder current?"""
    spec = get_stage(name)
    upstream = {}
    for up in spec.upstream:
        folder = output_dir(params, up)
        ok, why = artifacts.verify(folder)
        if not ok:
            raise UpstreamMissing(f"stage {name!r} needs the output of {up!r} at {folder}, which is not usable "
                                  f"({why}); run `python -m stages {up}` (or the whole flow) first")
        upstream[up] = artifacts.read_manifest(folder)
    fp = artifacts.fingerprint(
        name,
        params.select(spec.params),
        artifacts.code_hash(spec.code),
        {up: m["outputs"]["hash"] for up, m in upstream.items()},
    )
    folder = output_dir(params, name)
    current, reason = artifacts.verify(folder, fp)
    return StageState(name, fp, folder, current, reason, upstream)


def run_stage(name: str, params: Params, *, force: bool = False) -> dict[str, Any]:
    """Bring stage `name` up to date; return its manifest with `"executed"` set to whether it ran."""
    spec = get_stage(name)
    state = inspect(name, params)
    if state.current and not force:
        log.info("%s: up to date (fingerprint %s), nothing to do", name, state.fingerprint)
        return {**artifacts.read_manifest(state.folder), "executed": False}
    if state.folder.exists() and state.reason != "missing":
        log.warning("%s: rebuilding %s: %s", name, state.folder, state.reason)
    log.info("%s: running (fingerprint %s)", name, state.fingerprint)
    fn = _entry(spec)
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    work = Path(params.run.output_dir) / ".work" / f"{name}-{state.fingerprint[:16]}"
    work.mkdir(parents=True, exist_ok=True)
    with artifacts.atomic_output(state.folder) as tmp:
        ctx = StageContext(params=params, out=tmp, inputs={u: output_dir(params, u) for u in spec.upstream},
                           log=logging.getLogger(f"stages.{name}"), work=work)
        metrics = fn(ctx) or {}
        manifest = artifacts.write_manifest(tmp, {
            "stage": name,
            "fingerprint": state.fingerprint,
            "params": params.select(spec.params),
            "inputs": {u: {"fingerprint": m["fingerprint"], "outputs_hash": m["outputs"]["hash"]}
                       for u, m in state.upstream.items()},
            "code": {"hash": artifacts.code_hash(spec.code), "paths": list(spec.code), "git": _git_commit()},
            "metrics": metrics,
            "started_at": started.isoformat(),
            "wall_time_s": round(time.perf_counter() - t0, 3),
            "versions": _versions(),
        })
    shutil.rmtree(work, ignore_errors=True)
    artifacts.write_json_atomic(metrics_path(params, name), flat_metrics(metrics))
    log.info("%s: done in %.1fs -> %s", name, manifest["wall_time_s"], state.folder)
    return {**manifest, "executed": True}


def status(params: Params) -> list[dict[str, Any]]:
    """One row per stage: current or why not (stops inspecting past the first non-current stage)."""
    rows = []
    for name in STAGES:
        try:
            st = inspect(name, params)
            rows.append({"stage": name, "current": st.current, "reason": st.reason, "fingerprint": st.fingerprint})
        except UpstreamMissing as e:
            rows.append({"stage": name, "current": False, "reason": f"upstream not built ({e})", "fingerprint": ""})
    return rows


def _entry(spec: StageSpec):
    module, _, fn = spec.entry.partition(":")
    return getattr(importlib.import_module(module), fn)


def flat_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Scalars only (for `dvc metrics show`); tables and lists stay in the manifest."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in flat_metrics(v).items()})
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=artifacts.CODE_ROOT, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "stages"], cwd=artifacts.CODE_ROOT,
                               capture_output=True, text=True, timeout=5)
        if res.returncode == 0:
            return res.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None
