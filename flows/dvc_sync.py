"""Keep `dvc.lock` in step with what the Prefect flow built, and say so when it cannot.

After a flow run on `params.yaml` as it is (no overrides) with the default output folder,
the outputs on disk are exactly what `dvc.yaml` describes, so `dvc commit --force` records
them: a following `dvc status` is clean and `dvc repro` runs nothing. DVC is run as
`python -m dvc` with the flow's own interpreter (the project's environment), so it works
whether or not `dvc` is on PATH (under `make run` it is not).

When the lock cannot be recorded, the run's log says why (a warning when something is wrong,
an info line when the run differs from params.yaml on purpose), and `align status` ends with
`lock_status`: in step, missing or stale, and the command that fixes it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from stages.harness.artifacts import MANIFEST, lock
from stages.harness.dvcgen import OUTPUT_DIR
from stages.harness.registry import STAGES


def dvc_command() -> list[str] | None:
    """`<this interpreter> -m dvc`, or None when dvc is not installed for it."""
    try:
        found = importlib.util.find_spec("dvc") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    return [sys.executable, "-m", "dvc"] if found else None


def shown(cmd: list[str], root: Path) -> str:
    """The command as a person types it from `root` (the interpreter relative to it when inside)."""
    exe = Path(cmd[0])
    try:
        exe = exe.relative_to(root.resolve())
    except ValueError:
        pass
    return shlex.join([str(exe), *cmd[1:]])


def why_not_recorded(params_file: str, output_dir: str, overrides: list[str] | None) -> tuple[str, str] | None:
    """None when this run's outputs are what dvc.yaml describes; else (log level, reason)."""
    root = Path(params_file).resolve().parent
    if not (root / "dvc.yaml").is_file():
        return "debug", f"no dvc.yaml beside {params_file}: not a DVC checkout"
    if overrides:
        return "info", ("dvc.lock not updated: this run used overrides " + " ".join(overrides) + ", so its outputs are "
                        "not what params.yaml describes (`dvc status` reports those stages as changed)")
    if Path(params_file).name != "params.yaml":
        return "info", f"dvc.lock not updated: dvc.yaml reads params.yaml, this run read {params_file}"
    if Path(output_dir).resolve() != (root / OUTPUT_DIR).resolve():
        return "info", (f"dvc.lock not updated: dvc.yaml describes {root / OUTPUT_DIR}, this run wrote to "
                        f"{Path(output_dir).resolve()} (run.output_dir)")
    if not (root / ".dvc").is_dir():
        return "warning", f"dvc.lock not updated: {root} has dvc.yaml but no .dvc/ folder; run `dvc init` there"
    if dvc_command() is None:
        return "warning", (f"dvc.lock not updated: dvc is not installed for {sys.executable}; "
                           "install the project (`make install`) or `pip install 'dvc==3.67.*'`")
    return None


def commit_lock(root: Path) -> tuple[bool, str]:
    """`dvc commit --force` in `root`; (recorded, what happened)."""
    dvc = dvc_command()
    if dvc is None:  # why_not_recorded says so before a commit is tried
        return False, f"dvc.lock not updated: dvc is not installed for {sys.executable}"
    cmd = [*dvc, "commit", "--force"]  # not --quiet: it silences the errors too
    try:
        res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=_env())
    except subprocess.TimeoutExpired:
        return False, f"dvc.lock not updated: `{shown(cmd, root)}` took over 600 s"
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip()[-800:]
        return False, (f"dvc.lock not updated: `{shown(cmd, root)}` failed ({res.returncode}): {err}. "
                       "Until it succeeds, `dvc status` reports the stages as changed and `dvc repro` rebuilds them")
    return True, f"recorded the outputs in {root / 'dvc.lock'}"


def record_in_dvc_lock(params_file: str, output_dir: str, overrides: list[str] | None = None, *,
                       executed: bool = True) -> bool:
    """The flow's last step: record this run's outputs in dvc.lock when they are what dvc.yaml describes.

    With nothing `executed`, dvc.lock is written only when it is behind the outputs (`lock_behind`): a cached
    rerun stays fast, and one after a run killed before its commit records what that run built."""
    from prefect import get_run_logger

    logger = get_run_logger()
    root = Path(params_file).resolve().parent
    if (skip := why_not_recorded(params_file, output_dir, overrides)) is not None:
        level, reason = skip
        getattr(logger, level)(reason)
        return False
    if not executed and not lock_behind(root, output_dir):
        return False
    ok, message = commit_once(root, output_dir)
    (logger.info if ok else logger.warning)(message)
    return ok


def commit_once(root: Path, output_dir: str) -> tuple[bool, str]:
    """`commit_lock`, one run of a checkout at a time: runs that finish together would otherwise fail on DVC's
    repository lock. A run that gets its turn after another recorded the same outputs commits nothing."""
    with lock(root / ".dvc" / "tmp" / "align-commit"):
        if not lock_behind(root, output_dir):
            return True, "dvc.lock already records these outputs (committed by a concurrent run)"
        return commit_lock(root)


def lock_behind(root: Path, output_dir: str) -> bool:
    """Whether dvc.lock is missing, unreadable, or older than a stage output's manifest: then a run that built
    nothing still records the outputs (the run that built them was killed before or during its `dvc commit`)."""
    lock = root / "dvc.lock"
    try:
        written = lock.stat().st_mtime_ns
        yaml.safe_load(lock.read_text())
    except (OSError, yaml.YAMLError):
        return True
    manifests = [Path(output_dir) / name / MANIFEST for name in STAGES]  # dvc.yaml's stages, not promote
    return any(m.stat().st_mtime_ns > written for m in manifests if m.is_file())


def lock_status(root: str | Path) -> str | None:
    """One line for `align status`: is dvc.lock in step with the outputs? None outside a DVC checkout."""
    return lock_status_started(root)()


def lock_status_started(root: str | Path) -> Callable[[], str | None]:
    """`lock_status` with `dvc status` started now, in its own process: the returned function waits for it and
    gives the line. `align status` computes its own table meanwhile."""
    root = Path(root)
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        return lambda: None
    dvc = dvc_command()
    if dvc is None:
        return lambda: f"dvc.lock     unknown: dvc is not installed for {sys.executable} (make install)"
    fix = (f"`{shown([*dvc, 'commit', '--force'], root)}` records the outputs when every stage above is current, "
           "`align run` does it after building")
    if not (root / "dvc.lock").is_file():
        return lambda: f"dvc.lock     missing: `dvc repro` would rebuild every stage; {fix}"
    proc = subprocess.Popen([*dvc, "status", "--json"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())

    def line() -> str | None:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            return f"dvc.lock     unknown: `{shown([*dvc, 'status'], root)}` failed: {err.strip()[-300:]}"
        changed = sorted(json.loads(out or "{}"))
        if changed:
            return f"dvc.lock     stale for {', '.join(changed)}: `dvc repro` would rebuild them; {fix}"
        return "dvc.lock     in step: `dvc repro` has nothing to run"

    return line


def _env() -> dict[str, str]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1"}
