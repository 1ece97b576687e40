"""stages.harness.processes: a command run in its own process group, its output streamed line by line, its deadline
killing every process it started."""
import subprocess
import sys
import time

import pytest

from stages.harness.processes import LaunchFailed, failing_rank_tail, root_cause, run_command, stage_target


def test_stage_target_is_the_stage_command_line():
    assert stage_target("sft", "p.yaml", ["a=1", "b=2"]) == ["-m", "stages", "sft", "--params", "p.yaml",
                                                             "--set", "a=1", "--set", "b=2"]


def test_the_failing_rank_is_named_from_torchrun_s_root_cause():
    lines = ["[default0]:ok", "[default1]:Traceback", "[default1]:RuntimeError: boom", "Root Cause (first observed "
             "failure):", "  local_rank: 1 (pid: 7)"]
    assert failing_rank_tail(lines) == ["(local rank 1, the first to fail)", "[default1]:Traceback",
                                        "[default1]:RuntimeError: boom"]
    assert failing_rank_tail(["a", "b", "c"], n=2) == ["b", "c"]


def test_the_failing_rank_and_its_signal_are_read_from_torchrun_s_summary():
    """The lines torchrun prints (torch.distributed.elastic's failure template) when rank 1 was SIGKILLed."""
    summary = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-04_23:01:02",
               "  host      : h", "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 4242) SIGKILL",
               "  error_file: <N/A>", "  traceback : Signal 9 (SIGKILL) received by PID 4242"]
    assert root_cause(["[default0]:ok", *summary]) == "rank 1 (local rank 1) was killed by SIGKILL"
    summary[5] = "  exitcode  : 1 (pid: 4242)"
    assert root_cause(summary) == "rank 1 (local rank 1) exited with code 1"
    assert root_cause(["no summary"]) is None


def test_output_is_streamed_line_by_line_and_failure_raises():
    lines = []
    code = "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); sys.exit(3)"
    with pytest.raises(LaunchFailed, match="exited with code 3") as e:
        run_command([sys.executable, "-c", code], on_line=lines.append)
    assert lines == ["one", "two"] and e.value.returncode == 3 and e.value.tail == ["one", "two"]


def test_deadline_kills_the_group_and_the_sessions_it_started(tmp_path):
    """Like torchrun, the command starts a child in a session of its own; the deadline ends both."""
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(120)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            "print('started', flush=True); time.sleep(120)")
    start = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"past its deadline of 2 s \(run.launch.timeout_s\)"):
        run_command([sys.executable, "-c", code], on_line=lambda line: None, timeout_s=2, grace_s=2)
    assert time.monotonic() - start < 20
    child = int(pid_file.read_text())
    time.sleep(0.5)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    assert state == "" or state.startswith("Z"), f"child {child} still running ({state})"  # gone or a zombie


def test_shutdown_distributed_leaves_the_process_group_and_joins_threads(tmp_path):
    """A real gloo group (1 process, a file store): afterwards no group and no non-daemon thread is left."""
    import threading

    import torch.distributed as dist

    from stages.harness.processes import shutdown_distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (time.sleep(0.2), done.set()))
    worker.start()
    shutdown_distributed()
    assert not dist.is_initialized() and done.is_set() and not worker.is_alive()
    shutdown_distributed(barrier=False)  # twice, and outside any group: a no-op
