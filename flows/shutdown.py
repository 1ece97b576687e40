"""Stopping `align run` and `align serve` on SIGTERM: quickly, and with nothing left behind.

What a SIGTERM met without this: `align run` died at once and left its children running (the
temporary Prefect server of ephemeral mode, a launched training process group); `align serve`
went through Prefect's graceful shutdown and was still running 35 s later.

`stop_on_sigterm()` (align run) installs a handler that ends every process this one started,
children of children included (psutil walks the tree), and exits with 143. During a flow run
Prefect's own handler is installed first: it marks the run crashed, then sends the signal
again, which reaches this one. `force_exit_after()` (align serve) gives Prefect's graceful
shutdown `GRACE_S` seconds, then does the same; `align serve` ends with `exit_now` either way.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn

import psutil

GRACE_S = 2.0  # what a process tree gets between SIGTERM and SIGKILL, and Prefect's graceful stop
EXIT_CODE = 128 + signal.SIGTERM

log = logging.getLogger("flows.shutdown")


def end_process_tree(grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL the ones still alive after `grace_s`; their pids."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [c.pid for c in children]


def exit_now(command: str, last_line: str, code: int = EXIT_CODE) -> None:
    """End every child process, print `last_line` as the very last line and exit with `code`, without waiting
    for threads or exit handlers (a training stage's worker thread cannot be interrupted; Prefect's
    handlers would stop a temporary server that is already gone, and log it after `last_line`)."""
    from stages.harness import logs

    logs.console_level(logging.WARNING)
    pids = end_process_tree()
    log.info("%s: ended %d child process(es) %s", command, len(pids), pids)
    for handler in logging.getLogger().handlers:
        handler.flush()
    print(last_line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def stop_on_sigterm(command: str, last_line: str) -> None:
    """On SIGTERM: end every child process, print `last_line` and exit 143 at once; during a flow run, after
    Prefect's handler has had `GRACE_S` seconds to mark the run crashed.

    Prefect replaces this handler while a flow runs (`prefect.utilities.engine.capture_sigterm`): its own
    raises `TerminationSignal` in the main thread, and sends the signal again to this handler only once the
    flow engine has unwound. Unwinding waits for the task runner's threads, and a training stage's thread
    does not stop: the process would hang until the stage ended. So the handler Prefect installs is wrapped
    to arm `force_exit_after` first (Prefect installs whatever its module holds under that name).
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_now(f"{command}: SIGTERM", last_line))
    from prefect.utilities import engine

    prefects = engine._prefect_sigterm_handler
    if getattr(prefects, "armed_by_align", False):
        return

    def arm_then_prefects(sig_num: int, *args: object) -> NoReturn:  # Prefect's handler's signature
        force_exit_after(GRACE_S, f"{command}: SIGTERM", last_line)
        prefects(sig_num, *args)

    arm_then_prefects.__dict__["armed_by_align"] = True  # a function attribute, which mypy cannot declare
    engine._prefect_sigterm_handler = arm_then_prefects


def force_exit_after(grace_s: float, command: str, last_line: str, code: int = EXIT_CODE) -> None:
    """From a signal handler: if the process is still alive `grace_s` seconds from now, `exit_now`."""
    timer = threading.Timer(grace_s, exit_now, args=(command, last_line, code))
    timer.daemon = True
    timer.start()
