"""What the fault-injection campaign (benchmarks/faults.py) is made of: projects, fault injectors, checks.

A `Project` is a temporary copy of this repository (git + DVC initialised, small params.yaml, its own
Prefect server address) in which `align run`, `align status` and `dvc status` run as a user runs them.
The injectors start a real `align run` and SIGKILL it (or the process it started) at a chosen point:
a time offset into a stage, the moment a partial checkpoint exists, or a pause point that the
`sitecustomize` hook (`HOOK`, put on PYTHONPATH for the killed run only) holds the process at: the
manifest half written, written but not renamed, or between the two renames of a publish.
`check` then compares the project with the uninterrupted reference run, byte for byte.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.common import deep_update
from stages.harness.registry import STAGES

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STAGE_ORDER = tuple(STAGES)
TRAINING = tuple(name for name, spec in STAGES.items() if spec.trains)

SAVE_STEPS = {"sft": 3, "reward": 2, "policy": 2}  # checkpoint cadence of each training stage
# Small enough that `align run` builds every stage in seconds; checkpoints every few steps so that a kill
# can land before, inside and after a checkpoint save of each training stage.
SMALL = {
    "model": {"builtin": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}},
    "data": {"builtin": {"num_train": 400, "num_preference": 50, "num_eval": 20, "num_dev": 20}},
    "sft": {"max_steps": 8, "save_steps": SAVE_STEPS["sft"], "per_device_train_batch_size": 16,
            "logging_steps": 1},
    "reward": {"max_steps": 6, "save_steps": SAVE_STEPS["reward"], "per_device_train_batch_size": 8,
               "logging_steps": 1, "min_accuracy": 0.0},
    "score": {"num_prompts": 12, "n": 3, "generation": {"max_new_tokens": 6},  # the small model is never right:
              "reward_functions": ["reward_model"], "reward_weights": None, "min_score": None},  # RM-only pairs
    "policy": {"num_prompts": 16, "dpo": {"max_steps": 6, "save_steps": SAVE_STEPS["policy"],
                                          "per_device_train_batch_size": 8, "logging_steps": 1}},
    "evaluate": {"max_new_tokens": 4},
}

# Put first on PYTHONPATH of a killed run: holds the process at a pause point until the campaign kills it.
HOOK = '''\
import os

_AT, _MARK = os.environ.get("ALIGN_FAULT_AT"), os.environ.get("ALIGN_FAULT_MARK")
if _AT and _MARK:
    import time
    _replace, (_KIND, _STAGE) = os.replace, _AT.split(":")

    def _hold():
        open(_MARK, "w").close()
        time.sleep(3600)

    def replace(src, dst, *args, **kwargs):
        s, d = os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))
        into_stage = f"/.tmp-{_STAGE}-" in os.fspath(src)
        if _KIND == "manifest-half" and s == ".manifest.json.tmp" and into_stage:
            os.truncate(src, os.path.getsize(src) // 2)  # as if killed in the middle of writing it
            _hold()
        if _KIND == "manifest-unrenamed" and s == ".manifest.json.tmp" and into_stage:
            _hold()
        _replace(src, dst, *args, **kwargs)
        if _KIND == "between-renames" and d.startswith(f".old-{_STAGE}-"):
            _hold()  # the previous version moved aside, the new one not yet in place

    os.replace = replace
'''


def downstream(stage: str) -> list[str]:
    """`stage` and every stage that reads its output, directly or not, in pipeline order."""
    below = {stage}
    for name, spec in STAGES.items():
        if below & set(spec.upstream):
            below.add(name)
    return [s for s in STAGE_ORDER if s in below]


def base_env(work: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "DO_NOT_TRACK": "1", "DVC_NO_ANALYTICS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PATH": f"{BIN}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    env.pop("PREFECT_API_URL", None)
    return env


def sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def make_template(folder: Path, env: dict) -> Path:
    """A git + DVC checkout of this repository's code with the small params.yaml, nothing built."""
    repo = folder / "repo"
    keep = ("stages", "tasks", "flows", "configs", "dvc.yaml", ".dvcignore", ".gitignore", "pyproject.toml")
    repo.mkdir(parents=True)
    for name in keep:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, repo / name)
    params = deep_update(yaml.safe_load((ROOT / "params.yaml").read_text()), SMALL)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=f@f", "-c", "user.name=f", "commit", "-qm", "faults"]):
        res = sh(cmd, repo, env)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed in {repo}: {res.stderr[-2000:]}")
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    if (ROOT / ".dvc" / "plots").is_dir():
        shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    return repo


@dataclass
class Run:
    rc: int
    out: str
    seconds: float

    def summary(self) -> dict[str, str]:
        """{stage: "executed" | "cached"} from the table `align run` prints."""
        rows = {}
        for line in self.out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in STAGES and parts[1] in ("executed", "cached"):
                rows[parts[0]] = parts[1]
        return rows

    def last_line(self) -> str:
        lines = [line for line in self.out.splitlines() if line.strip()]
        return lines[-1] if lines else ""


class Project:
    """One temporary checkout in which faults are injected; `env` points its runs at `api_url`."""

    def __init__(self, repo: Path, env: dict, api_url: str | None):
        self.repo, self.env = repo, dict(env)
        self.env["PYTHONPATH"] = str(repo)
        if api_url:
            self.env["PREFECT_API_URL"] = api_url
        self.artifacts = repo / "artifacts"

    @classmethod
    def copy_of(cls, source: Project, dest: Path, api_url: str | None = None) -> Project:
        shutil.copytree(source.repo, dest, symlinks=True)
        return cls(dest, source.env, api_url or source.env.get("PREFECT_API_URL"))

    def align(self, *args: str, env: dict | None = None, timeout: float = 900) -> Run:
        t0 = time.perf_counter()
        res = sh([str(BIN / "align"), *args], self.repo, env or self.env, timeout)
        return Run(res.returncode, res.stdout + res.stderr, time.perf_counter() - t0)

    def start(self, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """`align <args>` in the background (its output in `log`)."""
        return self.start_command([str(BIN / "align"), *args], env, log)

    def start_command(self, cmd: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """`cmd` in the background in the project (its output in `log`, beside the project)."""
        log = log or self.repo.parent / f"{self.repo.name}-{time.monotonic_ns()}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=self.repo, env=env or self.env, stdout=out, stderr=subprocess.STDOUT)
        proc.log = log
        return proc

    def set_params(self, extra: dict) -> None:
        path = self.repo / "params.yaml"
        path.write_text(yaml.safe_dump(deep_update(yaml.safe_load(path.read_text()), extra), sort_keys=False))

    def remove(self, *stages: str) -> None:
        for name in stages:
            shutil.rmtree(self.artifacts / name, ignore_errors=True)
            (self.artifacts / "metrics" / f"{name}.json").unlink(missing_ok=True)

    def manifest(self, stage: str) -> dict | None:
        try:
            return json.loads((self.artifacts / stage / "manifest.json").read_text())
        except (OSError, ValueError):
            return None

    def params(self) -> dict:
        return yaml.safe_load((self.repo / "params.yaml").read_text())

    def status(self, *args: str) -> tuple[dict[str, str], str]:
        """`align status <args>`: ({stage: "current" | "stale: why"}, the dvc.lock line)."""
        res = self.align("status", *args)
        rows, dvc = {}, ""
        for line in res.out.splitlines():
            head, _, rest = line.partition(" ")
            if head in STAGES:
                rows[head] = rest.strip()
            elif head == "dvc.lock":
                dvc = rest.strip()
        return rows, dvc

    def dvc_status(self) -> str:
        res = sh([sys.executable, "-m", "dvc", "status"], self.repo, self.env)
        return (res.stdout + res.stderr).strip()


# --------------------------------------------------------------------------- checks


def outputs(project: Project) -> dict[str, dict]:
    """{stage: {"fingerprint", "files": {relative path: sha256}}} as the manifests record them."""
    out = {}
    for stage in STAGE_ORDER:
        m = project.manifest(stage)
        out[stage] = {"fingerprint": m and m.get("fingerprint"),
                      "files": m and {**m["outputs"]["files"]}}
    return out


def differences(project: Project, reference: dict[str, dict]) -> list[str]:
    """What differs from the reference outputs, file by file; [] when every stage's output files are
    byte-identical (their hashes equal the reference's and the files on disk still hash to them)."""
    from stages.harness import artifacts

    found = []
    mine = outputs(project)
    for stage, ref in reference.items():
        ok, why = artifacts.verify(project.artifacts / stage)
        if not ok:
            found.append(f"{stage}: {why}")
            continue
        if mine[stage]["fingerprint"] != ref["fingerprint"]:
            found.append(f"{stage}: fingerprint {mine[stage]['fingerprint']} != {ref['fingerprint']}")
        files = mine[stage]["files"]
        changed = sorted(k for k in set(files) | set(ref["files"]) if files.get(k) != ref["files"].get(k))
        found += [f"{stage}/{k}: not the reference's bytes" for k in changed]
    return found


def lock_held(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def leftovers(project: Project, spare_pids: set[int] = frozenset()) -> list[str]:
    """Temporary folders and files, checkpoints of unfinished builds, held locks (ours and DVC's) and live
    processes started in the project (other than `spare_pids`, e.g. its Prefect server): the target is []."""
    found = []
    for art in sorted(p for p in project.repo.glob("artifacts*") if p.is_dir()):  # other run.output_dirs too
        for path in art.rglob("*"):
            rel = path.relative_to(project.repo).as_posix()
            if path.name.startswith((".tmp-", ".old-")) or path.name.endswith(".tmp"):
                found.append(f"temporary {rel}")
            elif path.name.endswith(".lock") and path.is_file() and lock_held(path):
                found.append(f"held lock {rel}")
        work = art / ".work"
        if work.is_dir() and any(work.iterdir()):
            found += [f"unfinished work {p.relative_to(project.repo).as_posix()}" for p in work.iterdir()]
    dvc_tmp = project.repo / ".dvc" / "tmp"
    for name in ("lock", "rwlock.lock"):
        if (dvc_tmp / name).is_file() and lock_held(dvc_tmp / name):
            found.append(f"held DVC lock .dvc/tmp/{name}")
    try:
        rw = json.loads((dvc_tmp / "rwlock").read_text())
        if any(rw.values()):
            found.append(f"DVC rwlock entries {rw}")
    except (OSError, ValueError):
        pass
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        try:
            inside = str(project.repo) in (proc.info["cwd"] or "") or \
                any(str(project.repo) in a for a in proc.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if inside and proc.pid not in spare_pids and proc.pid != os.getpid():
            found.append(f"live process {proc.pid}: {' '.join(proc.info['cmdline'] or [])[:120]}")
    return found


def status_agrees(project: Project) -> tuple[bool, str]:
    """`align status` says every stage is current, and its dvc.lock line (`dvc status --json`) that DVC sees
    nothing to rebuild: both, or the details."""
    rows, dvc_line = project.status()
    all_current = len(rows) == len(STAGE_ORDER) and all(v == "current" for v in rows.values())
    dvc_clean = dvc_line.startswith("in step")
    if all_current and dvc_clean:
        return True, ""
    dvc = project.dvc_status()
    return False, f"align status {rows}, dvc.lock {dvc_line!r}; dvc status: {dvc.splitlines()[:6]}"


# --------------------------------------------------------------------------- injectors


def wait_for(predicate: Callable[[], object], proc: subprocess.Popen | None, timeout: float,
             poll_s: float = 0.002) -> object:
    """The first truthy value of `predicate()`; None when `proc` ended or `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(poll_s)
    return None


def building(project: Project, stage: str) -> bool:
    """Whether `stage` is being built: its temporary output folder exists."""
    return any(project.artifacts.glob(f".tmp-{stage}-*"))


def partial_checkpoint(project: Project, stage: str, after: int = 0) -> Path | None:
    """A checkpoint folder of `stage` being written (not yet complete by the stage's own rule) past step `after`."""
    from stages.pipeline.training import complete_checkpoint

    for folder in project.artifacts.glob(f".work/{stage}-*/checkpoints/checkpoint-*"):
        step = int(folder.name.rsplit("-", 1)[1])
        if step > after and not complete_checkpoint(folder):
            return folder
    return None


def dvc_commit_process(proc: subprocess.Popen) -> psutil.Process | None:
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "dvc" in " ".join(cmd) and "commit" in cmd:
                return child
    except psutil.Error:
        pass
    return None


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Outcome:
    """One injected fault and what the campaign found after it."""

    fault: str
    point: str
    recovered: bool = False
    identical: bool = False
    leftovers: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.recovered and self.identical and not self.leftovers


def stage(project: Project, name: str, *args: str) -> Run:
    """`python -m stages <name> <args>` in the project, to the end."""
    t0 = time.perf_counter()
    res = sh([sys.executable, "-m", "stages", name, *args], project.repo, project.env)
    return Run(res.returncode, res.stdout + res.stderr, time.perf_counter() - t0)


def stage_process(project: Project, name: str, *args: str) -> subprocess.Popen:
    log = project.repo.parent / f"{project.repo.name}-{name}-{time.monotonic_ns()}.log"
    return project.start_command([sys.executable, "-m", "stages", name, *args], log=log)


def complete_checkpoint_at(project: Project, stage: str, step: int) -> bool:
    from stages.pipeline.training import complete_checkpoint

    return any(map(complete_checkpoint, project.artifacts.glob(f".work/{stage}-*/checkpoints/checkpoint-{step}")))


def last_complete_checkpoint(project: Project, stage: str) -> int:
    """The step of the last complete checkpoint a killed build of `stage` left (0: none)."""
    from stages.pipeline.training import complete_checkpoint

    steps = [int(p.name.rsplit("-", 1)[1]) for p in project.artifacts.glob(f".work/{stage}-*/checkpoints/checkpoint-*")
             if complete_checkpoint(p)]
    return max(steps, default=0)


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def rank_process(proc: subprocess.Popen, rank: int) -> psutil.Process | None:
    """The process of global rank `rank` among `proc`'s descendants (its RANK environment variable)."""
    for child in descendants(proc):
        try:
            if child.environ().get("RANK") == str(rank) and "stages" in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


def all_bytes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`, the manifest included."""
    from stages.basics import file_hashes

    return file_hashes(folder, exclude=())


def folder_size(folder: Path) -> int:
    from stages.harness.artifacts import folder_bytes

    return folder_bytes(folder)


@contextlib.contextmanager
def tmpfs(folder: Path, room: int):
    """`folder`'s content moved onto a tmpfs mounted at `folder` (needs root) with `room` bytes free after it;
    yields whether it could be mounted. The content goes back to the disk when it ends."""
    aside = folder.with_name(folder.name + ".disk")
    os.replace(folder, aside)
    folder.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(folder)], capture_output=True)
    if res.returncode != 0:
        folder.rmdir()
        os.replace(aside, folder)
        yield False
        return
    try:
        shutil.copytree(aside, folder, dirs_exist_ok=True, symlinks=True)
        usage = shutil.disk_usage(folder)
        remount(folder, usage.used + room)
        yield True
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(folder, aside, symlinks=True)
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        folder.rmdir()
        os.replace(aside, folder)


def can_mount_tmpfs(work: Path) -> bool:
    probe = work / "tmpfs-probe"
    probe.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(probe)], capture_output=True)
    return True


def remount(folder: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, capture_output=True)


# --------------------------------------------------------------------------- the nightly deployment


def api(url: str, path: str, body: dict | None = None) -> Any:
    """The JSON answer of the Prefect server's REST API at `url` (…/api): GET `path`, or POST `body` to it."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as res:
        return json.loads(res.read())


def flow_run_state(url: str, flow_run_id: str) -> str:
    """SCHEDULED, PENDING, RUNNING, COMPLETED, FAILED, CRASHED, ..."""
    return (api(url, f"flow_runs/{flow_run_id}").get("state") or {}).get("type", "")


def run_table(url: str, flow_run_id: str) -> dict[str, str]:
    """{stage: "executed" | "cached"} of a flow run: its `align-run` table artifact (what `align run` prints)."""
    found = api(url, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]},
                                                        "key": {"any_": ["align-run"]}}})
    rows = json.loads(found[0]["data"]) if found else []
    return {r["stage"]: r["status"] for r in rows}


class Serve:
    """`align serve` in `project` (the align/full and align/nightly deployments) against the project's Prefect
    server; Prefect's runner storage goes under a folder of its own (TMPDIR), checked empty after `stop`."""

    def __init__(self, project: Project, timeout: float = 300):
        self.project, self.url = project, project.env["PREFECT_API_URL"]
        self.tmp = project.repo.parent / f"{project.repo.name}-serve-tmp"
        self.tmp.mkdir()
        # polls for scheduled runs every second (default 10 s): the nightly starts beside the manual runs
        env = {**project.env, "TMPDIR": str(self.tmp), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
        self.proc = project.start("serve", env=env)
        mine = str((project.repo / "params.yaml").resolve())
        # a deployment of the same name registered by an earlier serve still points at its own project
        if not wait_for(lambda: self.deployment().get("parameters", {}).get("params_file") == mine, self.proc,
                        timeout, 0.5):
            self.stop()
            raise RuntimeError(f"align serve did not register align/nightly for {mine}:\n{self.log()[-3000:]}")

    def deployment(self, name: str = "nightly") -> dict:
        try:
            return api(self.url, f"deployments/name/align/{name}")
        except OSError:  # not registered yet (404)
            return {}

    def trigger(self, name: str = "nightly", timeout: float = 120) -> tuple[subprocess.Popen, str]:
        """`prefect deployment run align/<name> --watch` in the background; (its process, the flow run id)."""
        import re

        proc = self.project.start_command([str(BIN / "prefect"), "deployment", "run", f"align/{name}", "--watch"])
        found = wait_for(lambda: re.search(r"UUID: ([0-9a-f-]{36})", Path(proc.log).read_text()), proc, timeout, 0.1)
        if not found:
            raise RuntimeError(f"prefect deployment run align/{name} made no flow run:\n"
                               f"{Path(proc.log).read_text()[-3000:]}")
        return proc, found.group(1)

    def log(self) -> str:
        return Path(self.proc.log).read_text()

    def stop(self, timeout: float = 60) -> list[str]:
        """SIGTERM, as a redeploy stops it; what is wrong after: an exit code other than 0, a process it
        started still alive, something left in its runner storage."""
        tree = descendants(self.proc)
        self.proc.send_signal(signal.SIGTERM)  # a no-op when it has ended
        problems = []
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            problems.append(f"align serve still running {timeout:.0f} s after SIGTERM")
            kill(self.proc.pid)
            self.proc.wait()
        if self.proc.returncode != 0:
            problems.append(f"align serve exited {self.proc.returncode} on SIGTERM: "
                            f"{Run(self.proc.returncode, self.log(), 0).last_line()[:300]}")
        _, alive = psutil.wait_procs(tree, timeout=10)
        problems += [f"live process {p.pid} of align serve" for p in alive]
        for p in alive:
            kill(p.pid)
        # Prefect's runner storage (runner_storage/<uuid>) must be gone; torch's compile cache may stay in TMPDIR
        problems += [f"runner storage {p.relative_to(self.tmp)}" for p in self.tmp.glob("runner_storage/*")]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return problems
