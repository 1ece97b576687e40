"""stages.harness.logs: one line per record on the console, tracebacks in the log file, causes on one line."""
import logging
import sys

from stages.harness import logs


def test_one_line_joins_a_multi_line_message():
    error = ValueError("d.jsonl: 2 bad row(s) of 9:\n  d.jsonl:2: empty\n  d.jsonl:5: not JSON\nFix the rows.")
    assert logs.one_line(error) == "d.jsonl: 2 bad row(s) of 9: d.jsonl:2: empty; d.jsonl:5: not JSON; Fix the rows."
    assert logs.one_line(KeyError()) == "KeyError"


def test_console_line_has_no_traceback_and_the_file_keeps_it(tmp_path):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("stages.sft", logging.ERROR, __file__, 1, "failed: %s", ("boom",),
                                   exc_info=sys.exc_info())
    record.task_run_name = "sft-3c7"
    console = logs.ConsoleFormatter().format(record)
    assert console.endswith("ERROR   sft-3c7: failed: boom") and "\n" not in console
    assert "Traceback (most recent call last)" in logs.FileFormatter().format(record)  # the record still has it


def test_log_file_gets_everything_and_old_ones_are_pruned(tmp_path):
    for i in range(logs.KEEP_LOG_FILES + 3):
        (tmp_path / f"old-{i}.log").write_text("x")
    path = logs.attach_log_file(tmp_path, "stage-sft")
    try:
        logging.getLogger("stages.test-logs").warning("kept")
    finally:
        logs.detach_log_file()
    assert "kept" in path.read_text() and logs.log_file() is None
    assert len(list(tmp_path.glob("*.log"))) == logs.KEEP_LOG_FILES
