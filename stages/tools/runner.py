"""Running a model's tool calls: every fault becomes the tool's answer, is counted, and never stops the run.

    runner = ToolRunner(timeout=5.0)                     # in this process (default), or mode="subprocess"
    result = runner.call({"add": add}, {"type": "function", "function": {"name": "add", "arguments": {...}}})
    result.message()   # {"role": "tool", "name": "add", "content": "5"}
    runner.counts      # Counter: calls, errors, timeouts, parse_errors (the trainer logs them as tools/<key>)

What the model reads back, by status:
- "ok": the return value (a string as is, anything else `str()`'d, as TRL does);
- "error": the tool raised (or the arguments did not fit its signature): `{"error": "ValueError: ..."}`;
- "unknown": a name that is not a tool of this episode: an error naming the tools it may call;
- "timeout": the call ran past `timeout` seconds: `{"error": "timed out after 1.0 s"}`;
- "parse_error": a malformed call (`stages.tools.calls`): `{"error": "could not parse the tool call: ..."}`.

Modes (`MODES`):
- "in_process" (default): the function runs in the training process, with all its rights (files, network,
  the model). The timeout interrupts it with SIGALRM when called from the main thread (Python code and sleeps
  stop; a C call that never returns to the interpreter does not); from another thread the call is abandoned
  and its thread left to finish in the background.
- "subprocess": each call runs in a forked child, killed at the timeout: for code execution and other calls
  that may hang or crash. The child gets a copy of the process, so it still has the same rights on files and
  network (use a sandbox for untrusted code); state it changes (an environment's attributes) does not come back,
  so environments' methods always run in process.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STATUSES = ("ok", "error", "unknown", "timeout", "parse_error")
COUNTED = {"error": "errors", "unknown": "errors", "timeout": "timeouts", "parse_error": "parse_errors"}


@dataclass
class ToolResult:
    name: str
    content: str
    status: str  # one of STATUSES

    def message(self) -> dict:
        """The `tool` message the model reads next (the shared message format)."""
        return {"role": "tool", "name": self.name, "content": self.content}


class ToolTimeout(BaseException):
    """Raised inside an in-process tool by the timeout's alarm (a BaseException: a tool's `except Exception`
    cannot swallow it)."""


def _error(text: str) -> str:
    return json.dumps({"error": text})


def _output(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _invoke(fn: Callable, arguments: dict) -> Any:
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**arguments))
    return fn(**arguments)


def _in_process(fn: Callable, arguments: dict, timeout: float | None) -> tuple[str, str]:
    if timeout is None:
        return "ok", _output(_invoke(fn, arguments))
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def alarm(signum, frame):
            raise ToolTimeout

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return "ok", _output(_invoke(fn, arguments))
        except ToolTimeout:
            return "timeout", _error(f"timed out after {timeout} s")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = _output(_invoke(fn, arguments))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            box["raised"] = e

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'call')}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return "timeout", _error(f"timed out after {timeout} s")
    if "raised" in box:
        raise box["raised"]
    return "ok", box["value"]


def _child(conn, fn: Callable, arguments: dict) -> None:
    try:
        conn.send(("ok", _output(_invoke(fn, arguments))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the tool's error
        conn.send(("error", _error(f"{type(e).__name__}: {e}")))
    finally:
        conn.close()


def _in_subprocess(fn: Callable, arguments: dict, timeout: float | None) -> tuple[str, str]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, arguments), daemon=True)
    proc.start()
    child.close()
    try:
        if parent.poll(timeout):
            status, content = parent.recv()
            proc.join(5)
            return status, content
        if not proc.is_alive():
            return "error", _error(f"the tool's process exited with code {proc.exitcode} without an answer")
        return "timeout", _error(f"timed out after {timeout} s (its process was killed)")
    except EOFError:
        proc.join(5)
        return "error", _error(f"the tool's process exited with code {proc.exitcode} without an answer")
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


MODES: dict[str, Callable[[Callable, dict, float | None], tuple[str, str]]] = {
    "in_process": _in_process, "subprocess": _in_subprocess}


class ToolRunner:
    """Runs tool calls with a timeout in one of `MODES`, counting calls and faults in `counts`."""

    def __init__(self, *, timeout: float | None = 30.0, mode: str = "in_process"):
        if mode not in MODES:
            raise ValueError(f"tool mode {mode!r}: unknown; supported: {', '.join(MODES)}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool_timeout = {timeout!r}: must be > 0 seconds (or None: no limit)")
        self.timeout, self.mode = timeout, mode
        self.counts: Counter[str] = Counter()

    def call(self, tools: dict[str, Callable], call: dict) -> ToolResult:
        """Run one parsed call (TRL's shape) against this episode's `tools` {name: function}."""
        self.counts["calls"] += 1
        function = call.get("function") or {}
        name, arguments = function.get("name", "?"), function.get("arguments") or {}
        fn = tools.get(name)
        if call.get("type", "function") != "function" or fn is None:
            result = ToolResult(name, _error(f"unknown tool {name!r}; the tools are: {', '.join(sorted(tools))}"),
                                "unknown")
        else:
            # environment methods carry their instance's state: never in a child process
            mode = "in_process" if inspect.ismethod(fn) else self.mode
            try:
                status, content = MODES[mode](fn, arguments, self.timeout)
            except Exception as e:  # noqa: BLE001 - the model reads the error; the run goes on
                status, content = "error", _error(f"{type(e).__name__}: {e}")
            result = ToolResult(name, content, status)
        self._count(result.status)
        return result

    def parse_error(self, error: str, name: str = "invalid_tool_call") -> ToolResult:
        """The answer to a call that could not be parsed (`stages.tools.calls.ParsedTurn.errors`)."""
        self.counts["calls"] += 1
        self._count("parse_error")
        return ToolResult(name, _error(f"could not parse the tool call: {error}"), "parse_error")

    def _count(self, status: str) -> None:
        if status in COUNTED:
            self.counts[COUNTED[status]] += 1

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (calls, errors, timeouts, parse_errors), then reset."""
        out = {key: self.counts.get(key, 0) for key in ("calls", "errors", "timeouts", "parse_errors")}
        self.counts.clear()
        return out
