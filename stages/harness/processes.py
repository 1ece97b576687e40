"""Child processes of a stage run: the command that runs one stage, run in its own process group.

`run_command` streams a command's output line by line, kills every process it started past
its deadline (or when the caller is interrupted), and raises `LaunchFailed` with the failing
rank's last lines when it exits non-zero. `stages.harness.launch` runs `accelerate launch` through it,
`stages.harness.runner.run_shard_process` a `python -m stages <stage> --shard K` process.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAUNCHED_ENV = "ALIGN_LAUNCHED"  # set in every launched rank: `python -m stages` must not launch again
TAIL_LINES = 30
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]+(\d+)\]:")  # torchrun --tee: [<role><local rank>]:
_ROOT_CAUSE = re.compile(r"Root Cause.*?local_rank:\s*(\d+)", re.S)
# torchrun's summary of the first failure: "rank      : 1 (local_rank: 1)" then "exitcode  : -9 (pid: 123) SIGKILL"
_ROOT_EXIT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)", re.S)


class LaunchFailed(RuntimeError):
    """The launched stage exited non-zero or ran past its deadline; every process it started has ended."""

    def __init__(self, message: str, returncode: int | None, tail: list[str]):
        super().__init__(message)
        self.returncode, self.tail = returncode, tail


def process_rank() -> int:
    """Global rank of this process (0 outside any launcher)."""
    return int(os.environ.get("RANK", "0"))


def inside_launch() -> bool:
    """Whether this process is a rank started by a launcher (ours, accelerate's or torchrun's)."""
    return LAUNCHED_ENV in os.environ or "LOCAL_RANK" in os.environ


def shutdown_distributed(*, barrier: bool = True, join_timeout_s: float = 10.0) -> None:
    """End this rank cleanly: leave the process group and join the threads we started.

    A rank that exits with its process group alive leaves c10d's C++ threads (gloo/NCCL
    workers, the TCPStore client) to be destroyed during interpreter teardown, which aborts
    with `terminate called without an active exception` now and then. Every rank first
    waits for the others (a barrier: no rank tears down while another still talks to it),
    then destroys the group; then non-daemon Python threads are joined. A no-op outside a
    distributed run; safe to call twice. barrier=False after a failure on this rank (the
    others may be inside a collective that this rank will never join).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and thread is not threading.main_thread() and not thread.daemon:
            thread.join(join_timeout_s)


def stage_target(stage: str, params_file: str | Path, overrides: list[str] | None = None) -> list[str]:
    return ["-m", "stages", stage, "--params", str(params_file), *(a for o in overrides or [] for a in ("--set", o))]


def run_command(cmd: list[str], *, on_line: Callable[[str], Any] = print, timeout_s: float | None = None,
                env: dict[str, str] | None = None, cwd: str | Path | None = None, grace_s: float = 15.0) -> None:
    """Run `cmd` in its own process group, `on_line` for each output line; raise LaunchFailed on failure.

    Past `timeout_s` (None or 0: no deadline) the group and every process it started (torchrun
    puts each rank in a session of its own) get SIGTERM, then SIGKILL after `grace_s`.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            errors="replace", start_new_session=True, env=env, cwd=cwd)
    lines: collections.deque[str] = collections.deque(maxlen=400)
    timer, timed_out = None, threading.Event()
    if timeout_s:
        def expire():
            timed_out.set()
            kill_tree(proc, grace_s)

        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()
    assert proc.stdout is not None  # stdout=PIPE
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            on_line(line)
        proc.wait()
    except BaseException:  # the caller was interrupted (Ctrl-C, a cancelled flow run): take every rank down
        kill_tree(proc, grace_s)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    if timed_out.is_set():
        raise LaunchFailed(f"{_show(cmd)}: past its deadline of {timeout_s:g} s (run.launch.timeout_s); every "
                           "process it started was killed", proc.returncode, list(lines)[-TAIL_LINES:])
    if proc.returncode != 0:
        tail = failing_rank_tail(list(lines))
        cause = root_cause(list(lines))
        raise LaunchFailed(f"{cause + '; ' if cause else ''}{_show(cmd)} exited with code {proc.returncode}; "
                           "last lines:\n" + "\n".join(tail), proc.returncode, tail)


def root_cause(lines: list[str]) -> str | None:
    """How the rank torchrun names as the first failure ended: "rank 1 (local rank 1) was killed by SIGKILL" or
    "rank 0 (local rank 0) exited with code 1"; None when torchrun printed no summary."""
    found = _ROOT_EXIT.search("\n".join(lines))
    if not found:
        return None
    rank, local, code = found.group(1), found.group(2), int(found.group(3))
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"rank {rank} (local rank {local}) {how}"


def failing_rank_tail(lines: list[str], n: int = TAIL_LINES) -> list[str]:
    """The last `n` lines of the rank torchrun names as the root cause, else the last `n` lines."""
    found = _ROOT_CAUSE.search("\n".join(lines))
    if found:
        mine = [line for line in lines if (m := _RANK_PREFIX.match(line)) and m.group(1) == found.group(1)]
        if mine:
            return [f"(local rank {found.group(1)}, the first to fail)", *mine[-n:]]
    return lines[-n:]


def kill_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of `proc` and the sessions of all its descendants; SIGKILL what is left."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    groups = set()
    for p in tree:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgid(0))  # never our own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace_s if sig == signal.SIGTERM else 5)
        if not alive:
            return


def _show(cmd: list[str]) -> str:
    if cmd[1:3] == ["-m", "accelerate.commands.launch"]:
        return "accelerate launch " + " ".join(cmd[3:])
    return " ".join(cmd)
