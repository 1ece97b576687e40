"""stages.tools.runner: faults become the tool's answer and are counted; hanging tools are stopped."""
import json
import os
import time

import pytest

from stages.tools.runner import ToolRunner


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def add(a: int, b: int) -> int:
    return a + b


def boom() -> str:
    raise ValueError("no luck")


def swallow() -> str:
    """A tool that catches Exception around its sleep: the timeout must still stop it."""
    try:
        time.sleep(30)
    except Exception:  # noqa: BLE001
        return "swallowed"
    return "late"


def pid() -> int:
    return os.getpid()


async def later(x: int) -> int:
    return x * 2


TOOLS = {f.__name__: f for f in (add, boom, swallow, pid, later)}


@pytest.mark.parametrize("mode", ["in_process", "subprocess"])
def test_results_errors_and_counts(mode):
    runner = ToolRunner(timeout=5.0, mode=mode)
    ok = runner.call(TOOLS, call("add", a=2, b=3))
    assert (ok.status, ok.message()) == ("ok", {"role": "tool", "name": "add", "content": "5"})
    raised = runner.call(TOOLS, call("boom"))
    assert raised.status == "error" and json.loads(raised.content) == {"error": "ValueError: no luck"}
    wrong = runner.call(TOOLS, call("add", a=1))  # a missing argument is the tool's error, not a crash
    assert wrong.status == "error" and "TypeError" in wrong.content
    unknown = runner.call(TOOLS, call("mul", a=1, b=2))
    assert unknown.status == "unknown" and "unknown tool 'mul'" in unknown.content and "add" in unknown.content
    assert runner.call(TOOLS, call("later", x=4)).content == "8"
    bad = runner.parse_error("tool call 1: invalid JSON")
    assert bad.status == "parse_error" and bad.name == "invalid_tool_call"
    assert runner.take_counts() == {"calls": 6, "errors": 3, "timeouts": 0, "parse_errors": 1}
    assert runner.take_counts() == {"calls": 0, "errors": 0, "timeouts": 0, "parse_errors": 0}


@pytest.mark.parametrize("mode", ["in_process", "subprocess"])
def test_a_hanging_tool_is_stopped_at_the_timeout(mode):
    runner = ToolRunner(timeout=1.0, mode=mode)
    start = time.monotonic()
    result = runner.call(TOOLS, call("swallow"))
    elapsed = time.monotonic() - start
    assert result.status == "timeout" and json.loads(result.content)["error"].startswith("timed out after 1.0 s")
    assert 0.9 <= elapsed < 10
    assert runner.take_counts()["timeouts"] == 1
    assert runner.call(TOOLS, call("add", a=1, b=1)).content == "2"  # the runner still works afterwards


def test_subprocess_mode_runs_in_another_process_and_in_process_here():
    here = os.getpid()
    assert ToolRunner(mode="in_process").call(TOOLS, call("pid")).content == str(here)
    assert ToolRunner(mode="subprocess").call(TOOLS, call("pid")).content != str(here)


def test_environment_methods_always_run_in_process():
    class Counter:
        def __init__(self):
            self.n = 0

        def bump(self) -> int:
            self.n += 1
            return self.n

    env = Counter()
    runner = ToolRunner(mode="subprocess")
    assert runner.call({"bump": env.bump}, call("bump")).content == "1" and env.n == 1  # its state changed here


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tool mode 'thread'"):
        ToolRunner(mode="thread")
    with pytest.raises(ValueError, match="tool_timeout = 0"):
        ToolRunner(timeout=0)
