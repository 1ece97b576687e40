"""Progress of a long loop as log lines with a rate and an ETA: training steps, sampled prompts, evaluated models.

    progress = Progress(log, total=len(rows), unit="prompts", what="score: sampling")
    for batch in batches:
        ...
        progress.advance(len(batch))
    progress.finish()

    10:42:07 INFO    stages.score: score: sampling 192/600 prompts (32%), 41.3 prompts/s, ETA 10s

The lines go to a `stages.*` logger, so they reach the console, the log file and, inside a
flow, the Prefect task log (tasks/stage.py forwards the `stages` logger). They are
rate-limited: at most one every `ALIGN_PROGRESS_EVERY_S` seconds (default 5; 0 logs every
update), plus the closing line of a loop that took longer than that. Third-party progress
bars are off (`stages.logs`): this is the only progress output.
"""
from __future__ import annotations

import logging
import os
import threading
import time

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
