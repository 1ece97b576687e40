"""Stage outputs: fingerprints, atomic writes, manifests and their verification.

The manifest is what decides whether a stage is current, for every entry point (the
Prefect flow, `python -m stages`, `dvc repro`). A stage's fingerprint hashes exactly what
`dvc.yaml` declares as its dependencies: the params keys it reads, the content of its
code, and the content hashes of its upstream outputs. An output folder counts as current
only if its manifest carries the expected fingerprint *and* its files still hash to what
the manifest recorded, so a deleted, truncated or edited file is rebuilt, never reused.

Outputs are written into a temporary sibling folder, the manifest last, then renamed into
place: a stage that crashes (or is killed, or runs out of disk) leaves no folder that looks
complete, and the previous version stays in place until the new one is whole. `lock`
serialises writers of one output folder across processes; `clean_leftovers` removes what a
killed writer left behind (called under the lock).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stages.basics import MANIFEST, file_hashes, hash_json, sha256_file, tree_hash  # noqa: F401 (used here and by callers)

# Top-level entries of an output folder that are logs, not results: they carry wall times, host names
# and process ids, so two builds of byte-identical weights differ in them. They stay in the folder and
# the manifest verifies them (`logs`), but they are kept out of the outputs hash that downstream
# fingerprints use: a rebuild that reproduces its results leaves everything below it current.
LOGS = ("log_history.json", "tensorboard", "dvclive")
CODE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding stages/, tasks/, flows/


def is_log(rel: str) -> bool:
    """Whether relative path `rel` of an output folder is a log (see LOGS)."""
    return rel.split("/", 1)[0] in LOGS


def input_hash(path: str | Path) -> str | None:
    """Content hash of a user's input file or folder (a data file, a model folder), or None when `path` names
    no file (a builtin or a hub id: the value alone, already in the params, identifies it). Memoised per
    (path, size, mtime) within the process: `status` and every stage's fingerprint ask again."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        return None
    stats = tuple((p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())))
    return _input_hash(path, stats)


@functools.lru_cache(maxsize=64)
def _input_hash(path: Path, stats: tuple) -> str:
    return sha256_file(path) if path.is_file() else tree_hash(file_hashes(path, exclude=()))


def code_hash(paths: tuple[str, ...], root: Path = CODE_ROOT) -> str:
    """Content hash of the stage's code (files or folders, relative to the code root)."""
    entries = {}
    for rel in paths:
        path = root / rel
        if path.is_dir():
            entries.update({f"{rel}/{k}": v for k, v in file_hashes(path, exclude=()).items() if k.endswith(".py")})
        elif path.is_file():
            entries[rel] = sha256_file(path)
        else:
            entries[rel] = "missing"
    return tree_hash(entries)


def fingerprint(stage: str, params: dict[str, Any], code: str, upstream: dict[str, str]) -> str:
    """What a stage's output is a function of: its params, its code, its inputs' content."""
    return hash_json({"stage": stage, "params": params, "code": code, "upstream": upstream})[:32]


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(folder: Path, expected_fingerprint: str | None = None) -> tuple[bool, str]:
    """(True, "") if `folder` is complete and unmodified (and has the expected fingerprint)."""
    if not folder.is_dir():
        return False, "missing"
    manifest = read_manifest(folder)
    if manifest is None:
        return False, f"{folder / MANIFEST} is missing or unreadable (an interrupted write?)"
    sealed = manifest.pop("manifest_hash", None)
    if sealed is not None and sealed != hash_json(manifest):
        return False, f"{folder / MANIFEST} was changed since it was written (its own hash does not match)"
    if expected_fingerprint is not None and manifest.get("fingerprint") != expected_fingerprint:
        return False, "stale: params, code or inputs changed since it was built"
    recorded = {**manifest.get("outputs", {}).get("files", {}), **manifest.get("logs", {}).get("files", {})}
    actual = file_hashes(folder)
    if actual != recorded:
        changed = sorted(set(recorded) ^ set(actual)
                         | {k for k in recorded if actual.get(k, recorded[k]) != recorded[k]})
        return False, f"files changed since the manifest was written: {', '.join(changed[:5])}"
    return True, ""


@contextlib.contextmanager
def atomic_output(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success it replaces `final`, on error it is removed.

    The caller writes the manifest last, inside the block (see `write_manifest`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if (tmp / MANIFEST).exists() is False:
            raise RuntimeError(f"internal: {tmp} has no manifest; outputs must be sealed by write_manifest")
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def lock_path(final: Path) -> Path:
    """The lock file of output folder `final`: a sibling (the folder itself is replaced on every build)."""
    final = Path(final)
    return final.parent / f".{final.name}.lock"


@contextlib.contextmanager
def lock(final: Path, *, on_wait: Callable[[str], None] | None = None, poll_s: float = 0.2) -> Iterator[None]:
    """Hold an exclusive lock on output folder `final` (fcntl.flock on a sibling lock file).

    Another process (or thread) building the same folder waits here; `on_wait` is called once
    with the holder's description. The kernel releases the lock when its holder dies, even by
    SIGKILL, so a crashed run never blocks the next one.
    """
    path = lock_path(final)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                on_wait(holder)
            while True:  # blocking flock cannot be interrupted cleanly by Ctrl-C in every runtime; poll instead
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def clean_leftovers(final: Path, log: logging.Logger | None = None) -> None:
    """Remove the temporary folders a killed writer of `final` left behind; call it holding `lock(final)`.

    A writer killed between its two renames (previous version moved aside, new one not yet in
    place) leaves `.old-<name>-*` and no `final`: that previous version is put back.
    """
    final = Path(final)
    if not final.parent.is_dir():
        return
    for path in sorted(final.parent.glob(f".old-{final.name}-*")):
        if not final.exists():
            os.replace(path, final)
            if log:
                log.warning("%s: restored the previous version from %s (a run was killed mid-rename)", final, path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    for path in final.parent.glob(f".tmp-{final.name}-*"):
        if log:
            log.warning("%s: removing %s, the partial output of a run that was killed", final, path.name)
        shutil.rmtree(path, ignore_errors=True)


# What writers that are not Python's own I/O say when the device is full: safetensors ("I/O error: No space left
# on device (os error 28)"); torch.save says only "unexpected pos ..." or "file write failed" (see `is_disk_full`).
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_NEARLY_FULL = 1 << 20  # bytes free under which a write error that names no cause counts as a full disk


def is_disk_full(exc: BaseException | None, folder: Path | None = None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that failed for lack of space.

    An OSError says so by its errno, safetensors in its message. torch.save's writer says neither
    (a RuntimeError "unexpected pos" or "file write failed"): with `folder` given, a RuntimeError
    raised while the device holding `folder` has less than 1 MiB free counts as a full disk too.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(exc).lower() for text in _DISK_FULL_TEXT):
            return True
        if folder is not None and isinstance(exc, RuntimeError) and free_bytes(folder) < _NEARLY_FULL:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(folder: Path) -> int:
    """Bytes free for this user on the device holding `folder` (or its closest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def folder_bytes(folder: Path) -> int:
    """Total size of the files under `folder` (0 when it does not exist)."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


class DiskFull(OSError):
    """A stage's output `folder` could not be written: the device filled. The message names the folder, how
    many bytes the stage had written when it failed (a lower bound of what it needs), the size of the
    previous version (what a rebuild usually needs again) and the bytes free."""

    def __init__(self, folder: Path, written: int, previous: int, free: int, cause: BaseException):
        self.folder, self.written, self.previous, self.free = Path(folder).absolute(), written, previous, free
        self.needed = max(written, previous)
        before = f"; its previous version takes {previous:,} bytes" if previous else ""
        super().__init__(errno.ENOSPC, f"no space left on device while writing {self.folder}: it needs at least "
                         f"{self.needed:,} bytes ({written:,} were written when the device filled{before}), "
                         f"{free:,} bytes are free there ({one_line(cause)})")

    def __str__(self) -> str:  # OSError's "[Errno 28] ..." prefix would come before the folder
        return self.strerror or ""  # set by __init__


def disk_full(folder: Path, written_in: tuple[Path, ...], cause: BaseException) -> DiskFull:
    """The DiskFull error of output `folder`, measured now (before the partial output is removed)."""
    return DiskFull(folder, sum(folder_bytes(p) for p in written_in), folder_bytes(folder),
                    free_bytes(Path(folder).parent), cause)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every output file and write the manifest (always the last file written), sealed by its own hash
    (`manifest_hash`, checked by `verify`). Returns the manifest without that seal.

    `outputs` holds the results (models, data, metrics files) and their `hash`, the one downstream
    fingerprints use; `logs` the log files (see LOGS), verified like the rest but hashed apart.
    """
    hashes = file_hashes(folder)
    results = {k: v for k, v in hashes.items() if not is_log(k)}
    logs = {k: v for k, v in hashes.items() if is_log(k)}
    manifest = {**manifest, "outputs": {"files": results, "hash": tree_hash(results)},
                "logs": {"files": logs, "hash": tree_hash(logs)}}
    manifest = json.loads(json.dumps(manifest, default=str))  # as it reads back, so its own hash verifies
    sealed = {**manifest, "manifest_hash": hash_json(manifest)}  # a changed byte in the manifest itself shows
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(sealed, indent=2, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
