"""Run one stage under the stage contract.

`run_stage(name, params)` checks whether the stage's output folder is current (see
`stages.harness.artifacts`); if not, it calls the stage's entry point with a `StageContext`
pointing at a temporary folder, then seals it with a manifest and renames it into place.
Every entry point goes through here: `python -m stages <stage>`, the Prefect tasks, `dvc repro`.
`run_shard(name, params, k, n)` computes share k of n of a stage's independent work (score's
prompt shards, evaluate's models) into the work folder that `run_stage` then assembles from.

Reliability contract:
- one writer per output folder: a lock file beside it (`stages.harness.artifacts.lock`); a second run
  with identical params waits, then finds the output current and reuses it;
- an upstream output counts only if it was built with *these* params (so two runs with other
  params sharing one `run.output_dir` fail loudly instead of mixing their artifacts; give
  concurrent runs with different params their own `run.output_dir`);
- a crash, SIGKILL or full disk never leaves an output that looks complete; what a killed run
  left is cleaned up by the next, and training stages resume from `ctx.work` checkpoints.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from stages.harness import artifacts, seeding
from stages.harness.config import Params
from stages.harness.errors import QualityGateFailed, StageFailed  # noqa: F401 (raised by stages, caught by callers)
from stages.harness.processes import process_rank, run_command, stage_target
from stages.harness.registry import DATA_FILES, STAGES, StageSpec, get_stage, resolve

log = logging.getLogger("stages")

VERSIONED = ("torch", "transformers", "tokenizers", "peft", "accelerate", "datasets", "align")


class UpstreamMissing(RuntimeError):
    pass


@dataclass
class StageContext:
    """What a stage's `run` receives: its params, where to write, where its inputs are."""

    params: Params
    out: Path  # temporary folder; everything written here becomes the stage's output
    inputs: dict[str, Path]  # upstream stage name -> its (verified) output folder
    log: logging.Logger
    work: Path  # persists across crashed attempts of this fingerprint (checkpoints); removed on success
    stage: str = ""  # the stage's name (its trackers' run name, its model card)


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


def inspect(name: str, params: Params, memo: dict[str, str | None] | None = None) -> StageState:
    """Compute the stage's fingerprint from its params, code and upstream outputs; is its folder current?
    `memo`: expected fingerprints of upstream stages, shared by calls on the same params and outputs (`status`)."""
    spec = get_stage(name)
    upstream, memo = {}, {} if memo is None else memo
    for up in spec.upstream:
        folder = output_dir(params, up)
        ok, why = artifacts.verify(folder)
        if not ok:
            raise UpstreamMissing(f"stage {name!r} needs the output of {up!r} at {folder}, which is not usable "
                                  f"({why}); run `python -m stages {up}` (or the whole flow) first")
        upstream[up] = artifacts.read_manifest(folder)
        built_for = _expected_fingerprint(up, params, memo)
        if upstream[up].get("fingerprint") != built_for:
            raise UpstreamMissing(f"stage {name!r} needs the output of {up!r} at {folder}, but it was built with "
                                  f"other params, code or inputs than this run's (another run sharing "
                                  f"run.output_dir = {params.run.output_dir}?); run `python -m stages {up}` first, "
                                  "and give concurrent runs with different params their own run.output_dir")
    fp = _fingerprint(name, params, {up: m["outputs"]["hash"] for up, m in upstream.items()})
    folder = output_dir(params, name)
    current, reason = artifacts.verify(folder, fp)
    return StageState(name, fp, folder, current, reason, upstream)


def _fingerprint(name: str, params: Params, upstream_hashes: dict[str, str],
                 root: Path = artifacts.CODE_ROOT) -> str:
    """The stage's params keys, the content of its code (the import closure of its module, read under `root`),
    its upstream outputs' hashes and the content of the user's files it reads (StageSpec.inputs)."""
    spec = get_stage(name)
    code = artifacts.code_hash(spec.code(root, params), root)
    files = input_hashes(spec, params)
    inputs = {**upstream_hashes, **files}
    return artifacts.fingerprint(name, _by_content(params.select(spec.params), files), code, inputs)


def input_hashes(spec: StageSpec, params: Params) -> dict[str, str]:
    """{"file:<key>": content hash} of the user's inputs the stage reads (StageSpec.inputs) that exist: for a data
    key, the hash of the rows it gives (`stages.data.hub.rows_hash`: the same rows hash alike as a .jsonl file, a
    hub-layout folder, a glob or a cached hub id); for anything else (a model folder), its files' bytes; for a
    list (evaluate.lm_eval.tasks: task YAML paths among registry names), those of each entry that names a file,
    as `<key>[<index>]`."""
    from stages.data.hub import rows_hash

    hashes: dict[str, str | None] = {}
    for key, value in params.select(spec.inputs).items():
        if key in DATA_FILES:
            hashes[key] = rows_hash(key, value)
        elif isinstance(value, str):
            hashes[key] = artifacts.input_hash(shipped_file(value))
        elif isinstance(value, list):
            hashes.update({f"{key}[{i}]": artifacts.input_hash(v) for i, v in enumerate(value) if isinstance(v, str)})
    return {f"file:{key}": h for key, h in hashes.items() if h is not None}


def shipped_file(name: str) -> str:
    """The file a shipped model's name stands for (`builtin:smollm2-135m-instruct`: the GGUF its package installs,
    so a new release of that package makes the stages stale), else `name`."""
    from stages.builtin import smollm2

    if name != smollm2.NAME:
        return name
    try:
        return str(smollm2.gguf_path())
    except FileNotFoundError:  # preflight names the missing package
        return name


def _by_content(selected: dict[str, Any], files: dict[str, str]) -> dict[str, Any]:
    """The selected params with every data key whose rows are hashed in `files` replaced by a marker: its rows
    identify it, not where they lie or how they are spelled (a path, a folder, a mapping with a column map)."""
    for entry in files:
        key = entry.removeprefix("file:")
        if key not in DATA_FILES:
            continue
        section, _, leaf = key.rpartition(".")
        if key in selected:
            selected[key] = "rows"
        elif isinstance(selected.get(section), dict):
            selected[section][leaf] = "rows"
    return selected


def _expected_fingerprint(name: str, params: Params, memo: dict[str, str | None] | None = None) -> str | None:
    """The fingerprint stage `name`'s output would carry if built with `params` from the upstream outputs on
    disk (read from their manifests, files not re-hashed: `inspect` verifies the direct upstreams)."""
    memo = {} if memo is None else memo
    if name not in memo:
        hashes: dict[str, str] | None = {}
        for up in get_stage(name).upstream:
            m = artifacts.read_manifest(output_dir(params, up))
            if m is None or _expected_fingerprint(up, params, memo) != m.get("fingerprint"):
                hashes = None
                break
            hashes[up] = m["outputs"]["hash"]
        memo[name] = None if hashes is None else _fingerprint(name, params, hashes)
    return memo[name]


def run_stage(name: str, params: Params, *, force: bool = False) -> dict[str, Any]:
    """Bring stage `name` up to date; return its manifest with `"executed"` set to whether it ran.

    Holds the output folder's lock while building: a concurrent run of the same stage waits, and
    finds the output current when it gets the lock (unless `force`).
    """
    spec = get_stage(name)
    state = inspect(name, params)
    if state.current and not force:
        log.info("%s: up to date (fingerprint %s), nothing to do", name, state.fingerprint)
        return {**artifacts.read_manifest(state.folder), "executed": False}
    if process_rank() > 0:  # a launched rank other than the main one (stages.harness.launch): writes nothing
        return _follow(spec, params, state)
    with artifacts.lock(state.folder, on_wait=lambda holder: log.info(
            "%s: waiting for %s, locked by %s", name, artifacts.lock_path(state.folder), holder)):
        artifacts.clean_leftovers(state.folder, log)
        state = inspect(name, params)  # another run may have built it while we waited
        if state.current and not force:
            log.info("%s: built by a concurrent run (fingerprint %s), reusing it", name, state.fingerprint)
            return {**artifacts.read_manifest(state.folder), "executed": False}
        try:
            return _build(spec, params, state)
        except OSError as e:
            if not artifacts.is_disk_full(e):
                raise
            what = str(e) if isinstance(e, artifacts.DiskFull) else \
                f"no space left on device while writing {state.folder} ({e})"
            raise StageFailed(f"{name}: {what}; nothing was published and the previous output, if any, is intact; "
                              "free space and rerun (checkpoints in run.output_dir/.work are kept)") from e
        except FloatingPointError as e:  # stages.trainers.callbacks.NumericGuard: a NaN/Inf loss or gradient
            raise StageFailed(f"{name}: {e}") from e
        finally:  # a failed stage keeps its checkpoints for the rerun, but leaves no empty folders behind
            work = work_dir(params, name, state.fingerprint)
            for folder in (work, work.parent):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()


def _build(spec: StageSpec, params: Params, state: StageState) -> dict[str, Any]:
    name = spec.name
    if state.folder.exists() and state.reason != "missing":
        log.warning("%s: rebuilding %s: %s", name, state.folder, state.reason)
    log.info("%s: running (fingerprint %s)", name, state.fingerprint)
    fn = resolve(spec.entry)
    started, t0 = datetime.now(UTC), time.perf_counter()
    work = work_dir(params, name, state.fingerprint)
    work.mkdir(parents=True, exist_ok=True)
    code = spec.code(params=params)
    with artifacts.atomic_output(state.folder) as tmp:
        ctx = StageContext(params=params, out=tmp, inputs={u: output_dir(params, u) for u in spec.upstream},
                           log=logging.getLogger(f"stages.{name}"), work=work, stage=name)
        seeding.prepare(params.run)  # before the stage draws anything (a fresh head, LoRA, dropout)
        _generation_backends()  # forget what ran before this stage in the process
        try:
            metrics = fn(ctx) or {}
            backends = sorted(set(_generation_backends()) | _shard_backends(work))
            manifest = artifacts.write_manifest(tmp, {
                "stage": name,
                "fingerprint": state.fingerprint,
                "params": params.select(spec.params),
                "inputs": {u: {"fingerprint": m["fingerprint"], "outputs_hash": m["outputs"]["hash"]}
                           for u, m in state.upstream.items()},
                "files": input_hashes(spec, params),
                "code": {"hash": artifacts.code_hash(code), "paths": list(code), "git": _git_commit()},
                "metrics": metrics,
                "started_at": started.isoformat(),
                "wall_time_s": round(time.perf_counter() - t0, 3),
                "versions": _versions(),
                "determinism": seeding.environment(params.run.device),
                **({"generation": {"backends": backends}} if backends else {}),
            })
        except Exception as e:  # a full disk is measured here, before atomic_output removes the partial output
            if artifacts.is_disk_full(e, tmp):
                raise artifacts.disk_full(state.folder, (tmp, work), e) from e
            raise
    shutil.rmtree(work, ignore_errors=True)
    artifacts.write_json_atomic(metrics_path(params, name), flat_metrics(metrics))
    log.info("%s: done in %.1fs -> %s", name, manifest["wall_time_s"], state.folder)
    return {**manifest, "executed": True}


def run_shard(name: str, params: Params, shard: int, num_shards: int) -> dict[str, Any]:
    """Compute share `shard` of `num_shards` of stage `name`'s independent work into its work folder;
    publish nothing. Then `run_stage` (same params, so the same fingerprint and work folder) finds the
    shares saved and only assembles and seals the output.

    For the stages whose StageSpec names `shards` (ctx, shard, num_shards): score (prompt shards) and
    evaluate (models). Shares may run at once, in processes or on machines sharing `run.output_dir`:
    each writes only its own files, atomically, so no lock is taken. Not in threads of one process:
    sampling seeds torch's process-wide RNG (use `run_shard_process`). A current stage computes nothing.
    Returns {"stage", "fingerprint", "shard", "num_shards", "executed", **the module's summary}.
    """
    spec = get_stage(name)
    fn = _shard_entry(spec)
    if not (isinstance(num_shards, int) and isinstance(shard, int) and 0 <= shard < num_shards):
        raise ValueError(f"shard {shard} of {num_shards}: need 0 <= shard < num_shards")
    state = inspect(name, params)
    row = {"stage": name, "fingerprint": state.fingerprint, "shard": shard, "num_shards": num_shards}
    if state.current:
        log.info("%s: up to date (fingerprint %s), no shard to compute", name, state.fingerprint)
        return {**row, "executed": False}
    work = work_dir(params, name, state.fingerprint)
    work.mkdir(parents=True, exist_ok=True)
    log.info("%s: computing shard %d of %d into %s", name, shard, num_shards, work)
    with tempfile.TemporaryDirectory(prefix=f"{name}-shard{shard}-") as tmp:  # a shard publishes no output
        ctx = StageContext(params=params, out=Path(tmp), inputs={u: output_dir(params, u) for u in spec.upstream},
                           log=logging.getLogger(f"stages.{name}"), work=work, stage=name)
        seeding.prepare(params.run, sharing=num_shards)
        _generation_backends()
        summary = fn(ctx, shard, num_shards) or {}
        backends = _generation_backends()
    if backends:  # for the manifest the stage writes when it assembles the shares
        artifacts.write_json_atomic(work / "generation" / f"shard-{shard}-of-{num_shards}.json", backends)
    return {**row, "executed": True, **summary}


def run_shard_process(name: str, params: Params, shard: int, num_shards: int, *,
                      on_line: Callable[[str], Any] = print, timeout_s: float | None = None) -> None:
    """`run_shard` in a fresh `python -m stages <name> --shard K --num-shards N` process (its own RNG and
    threads: what concurrent shards of one machine need); raises `stages.harness.processes.LaunchFailed` if it fails."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # no oversubscription while torch starts (the stage then sets run.threads, "auto" split between the shards)
    env.setdefault("OMP_NUM_THREADS", str(seeding.resolve_threads(params.run.threads, sharing=num_shards)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(artifacts.CODE_ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix=f"{name}-shard{shard}-") as tmp:
        params_file = Path(tmp) / "params.yaml"  # the resolved params, overrides included
        params_file.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False))
        cmd = [sys.executable, *stage_target(name, params_file), "--shard", str(shard), "--num-shards", str(num_shards)]
        run_command(cmd, on_line=on_line, timeout_s=timeout_s, env=env)


def _generation_backends() -> list[str]:
    """The generation backends ("hf", "decoder", "vllm") that produced completions in this process since the
    last call (`stages.generation.common.take_backends`); none when generation was never imported."""
    common = sys.modules.get("stages.generation.common")
    return common.take_backends() if common is not None else []


def _shard_backends(work: Path) -> set[str]:
    """The backends the stage's shares computed by `run_shard` used (their record in the work folder)."""
    return {name for f in sorted((work / "generation").glob("*.json")) for name in json.loads(f.read_text())}


def _shard_entry(spec: StageSpec):
    if spec.shards is None:
        sharded = [s.name for s in STAGES.values() if s.shards]
        raise ValueError(f"stage {spec.name!r} has no shards to compute apart; sharded stages: {', '.join(sharded)}")
    return resolve(spec.shards)


def work_dir(params: Params, name: str, fingerprint: str) -> Path:
    """Checkpoints of a build; shared by every rank of a launched stage, kept across crashed attempts."""
    return Path(params.run.output_dir) / ".work" / f"{name}-{fingerprint[:16]}"


def _follow(spec: StageSpec, params: Params, state: StageState) -> dict[str, Any]:
    """A launched rank other than global rank 0: it takes part in the stage's collective work (training,
    the gathers of a sharded save) with a throwaway output folder; rank 0 alone writes the output, the
    manifest and the metrics. It takes no lock (rank 0 holds it while all ranks train)."""
    work = work_dir(params, spec.name, state.fingerprint)
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-rank{process_rank()}-") as tmp:
        ctx = StageContext(params=params, out=Path(tmp), inputs={u: output_dir(params, u) for u in spec.upstream},
                           log=logging.getLogger(f"stages.{spec.name}"), work=work, stage=spec.name)
        seeding.prepare(params.run)
        metrics = resolve(spec.entry)(ctx) or {}
    return {"stage": spec.name, "fingerprint": state.fingerprint, "metrics": metrics, "executed": True}


def status(params: Params) -> list[dict[str, Any]]:
    """One row per stage: current or why not (stops inspecting past the first non-current stage)."""
    rows, memo = [], {}
    for name in STAGES:
        try:
            st = inspect(name, params, memo)
            rows.append({"stage": name, "current": st.current, "reason": st.reason, "fingerprint": st.fingerprint})
        except UpstreamMissing as e:
            rows.append({"stage": name, "current": False, "reason": f"upstream not built ({e})", "fingerprint": ""})
    return rows


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
