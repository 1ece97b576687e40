"""The helpers both the building blocks and the harness use; this module imports nothing of ours.

- `stable_seed`: one seed from ints and int sequences, the same in every process, run and machine;
- `sha256_file`, `file_hashes`, `tree_hash`, `hash_json`: content hashes of files, folders and JSON;
- `Progress`: a long loop's progress as rate-limited log lines with a rate and an ETA:

      progress = Progress(log, total=len(rows), unit="prompts", what="score: sampling")
      for batch in batches:
          progress.advance(len(batch))
      progress.finish()     # INFO stages.score: score: sampling 192/600 prompts (32%), 41.3 prompts/s, ETA 10s

  Lines go to a `stages.*` logger (the console, the log file and, inside a flow, the Prefect task
  log), at most one every `ALIGN_PROGRESS_EVERY_S` seconds (default 5; 0 logs every update), plus
  the closing line of a loop that took longer. Third-party progress bars are off (`stages.harness.logs`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"  # the file that seals every output folder (stages.harness.artifacts)
_CHUNK = 1 << 20


def stable_seed(*parts: int | Iterable[int]) -> int:
    """A seed in [0, 2**63) from ints and sequences of ints, the same in every process, run and machine.

    BLAKE2b over the parts' decimal digits (Python's `hash` is salted per process); a sequence
    is framed by its length, so (1, [2, 3]) and ([1, 2], 3) differ.
    """
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, int):
            h.update(f"i{part};".encode())
        else:
            items = [int(i) for i in part]
            h.update(f"s{len(items)}:{','.join(map(str, items))};".encode())
    return int.from_bytes(h.digest(), "big") >> 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_hashes(folder: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """{relative posix path: sha256} of every file under `folder`, sorted."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in exclude or "__pycache__" in rel:
            continue
        out[rel] = sha256_file(path)
    return out


def tree_hash(hashes: dict[str, str]) -> str:
    return hash_json(sorted(hashes.items()))


DEFAULT_EVERY_S = 5.0


def every_s() -> float:
    """Seconds between two progress lines: `ALIGN_PROGRESS_EVERY_S`, default 5."""
    try:
        return max(0.0, float(os.environ.get("ALIGN_PROGRESS_EVERY_S", DEFAULT_EVERY_S)))
    except ValueError:
        return DEFAULT_EVERY_S


def duration(seconds: float) -> str:
    """12s, 3m08s, 1h02m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Rate-limited "done/total (pct), rate, ETA" lines for one loop.

    `start`: units already done before this run (a resumed training run): the rate and ETA count
    only what this run did. `clock` is injectable so tests can drive time.
    """

    def __init__(self, log: logging.Logger, *, total: int, unit: str, what: str = "", start: int = 0,
                 every: float | None = None, clock=time.monotonic):
        self.log, self.total, self.unit, self.what = log, max(int(total), 0), unit, what
        self.start = self.done = start
        self.every = every_s() if every is None else every
        self.clock = clock
        self.t0 = self.last = clock()
        self.lines = 0
        self.lock = threading.RLock()

    def advance(self, n: int = 1, **extra) -> None:
        with self.lock:
            done = self.done + n
        self.update(done, **extra)

    def update(self, done: int, **extra) -> None:
        """`done` units finished so far; `extra` (e.g. loss=1.23) is appended to the line."""
        with self.lock:  # the vllm backend advances from its request threads
            self.done = done
            now = self.clock()
            if now - self.last < self.every or done >= self.total:
                return
            self.last = now
            self.lines += 1
        self.log.info("%s", self.line(now, extra))

    def finish(self, **extra) -> None:
        """The closing line, if this loop printed any or took longer than one interval."""
        now = self.clock()
        if self.lines or now - self.t0 >= self.every:
            self.log.info("%s", self.line(now, extra, closing=True))

    def rate(self, now: float) -> float:
        elapsed = now - self.t0
        return (self.done - self.start) / elapsed if elapsed > 0 else 0.0

    def line(self, now: float, extra: dict, closing: bool = False) -> str:
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = self.rate(now)
        parts = [f"{self.what + ' ' if self.what else ''}{self.done}/{self.total} {self.unit}{pct}"]
        parts.append(f"{rate:.3g} {self.unit}/s")
        if closing:
            parts.append(f"done in {duration(now - self.t0)}")
        elif rate > 0:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()]
        return ", ".join(parts)


def import_user_module(module_name: str):
    """The module a user's import path names (a reward function, a tool); ValueError saying why it cannot be
    imported: not found (and how to make it findable), or the module's own error while importing. The caller adds
    the params key."""
    import importlib

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"module {module_name} not found (install its package, or run from the folder that "
                             "contains it / add that folder to PYTHONPATH)") from None
        raise ValueError(f"importing {module_name} failed: {e}") from e
    except Exception as e:  # noqa: BLE001 - the module itself raised while importing: the user's to fix
        raise ValueError(f"importing {module_name} failed: {type(e).__name__}: {e}") from e
