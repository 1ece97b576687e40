"""Console and log-file output of every entry point (`align ...`, `python -m stages ...`).

`setup()` is the one place that decides what a person sees:

- the console gets one line per log record, never a traceback (Prefect's "Task run failed"
  and "Flow run failed" records carry one each: two walls of the same error);
- a log file gets everything, tracebacks included (`attach_log_file`); a failed command
  prints its path and then, as its very last line, the one-line cause (`report_failure`);
- third-party progress bars are off (transformers, huggingface_hub, datasets, tqdm): long
  stages report progress as rate-limited log lines instead (`stages.basics`).

It must run before Prefect is imported: Prefect installs its own console handler on the root
logger only when the root logger has none, so with ours in place Prefect's records (the
flow and task run logs) go through the same two handlers as the stages' own.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(where)s %(message)s"
DATEFMT = "%H:%M:%S"
KEEP_LOG_FILES = 20  # per folder: older logs of finished commands are removed

# read by huggingface_hub, transformers and datasets at import, by tqdm (>= 4.66) for every bar
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
             "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "DVC_NO_ANALYTICS": "1"}
THIRD_PARTY = ("transformers", "datasets", "huggingface_hub", "accelerate", "peft", "urllib3", "httpx", "filelock",
               "absl")  # absl: rouge_score logs "Using default tokenizer." at INFO per call


class ConsoleFormatter(logging.Formatter):
    """One line per record: time, level, where (the Prefect task/flow run, else the logger) and the message;
    tracebacks are left to the log file."""

    def __init__(self):
        super().__init__(FORMAT, DATEFMT)

    def format(self, record: logging.LogRecord) -> str:
        line = logging.makeLogRecord(record.__dict__)  # a copy: the file handler still needs exc_info
        line.exc_info = line.exc_text = line.stack_info = None
        line.where = _where(record)
        return super().format(line)


class FileFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)-7s %(where)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.where = _where(record)
        return super().format(record)


def _where(record: logging.LogRecord) -> str:
    run = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
    return f"{run}:" if run else f"{record.name}:"


class ConsoleHandler(logging.StreamHandler):
    """stderr at INFO, one line per record (a named class: Prefect keeps a root logger that has one)."""

    def __init__(self):
        super().__init__()
        self.setLevel(logging.INFO)
        self.setFormatter(ConsoleFormatter())

    @property
    def stream(self):  # whatever sys.stderr is now (pytest's capture replaces it per test)
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class LogFileHandler(logging.FileHandler):
    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8", delay=False)
        self.setLevel(logging.DEBUG)
        self.setFormatter(FileFormatter())


def quiet_third_party() -> None:
    """No third-party progress bars or telemetry, whatever was imported already."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules:
        import transformers.utils.logging as tl

        tl.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def setup(level: int = logging.INFO) -> None:
    """Console logging for an entry point: records at `level` and above on the console (the log file gets the
    stages' DEBUG lines too), third-party libraries at WARNING, no bars.

    Idempotent: a second call (an in-process test, `align stage` calling `python -m stages`'s
    main) changes nothing but the level.
    """
    quiet_third_party()
    root = logging.getLogger()
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        root.addHandler(ConsoleHandler())
    root.setLevel(logging.INFO)
    console_level(level)
    # the stages' DEBUG lines (every logged training dict) reach the log file only
    logging.getLogger("stages").setLevel(min(level, logging.DEBUG) if level <= logging.INFO else level)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    if "transformers" in sys.modules:  # its own stderr handler would print its warnings a second time
        import transformers.utils.logging as tl

        tl.disable_default_handler()
        tl.enable_propagation()


def console_level(level: int) -> None:
    """From now on the console shows only records at `level` or above (the log file still gets everything)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ConsoleHandler):
            handler.setLevel(level)


def attach_log_file(folder: str | Path, command: str) -> Path:
    """Everything logged from now on, tracebacks included, also goes to `<folder>/<command>-<time>-<pid>.log`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{command.replace(' ', '-')}-{stamp}-{os.getpid()}.log"
    detach_log_file()
    logging.getLogger().addHandler(LogFileHandler(path))
    _prune(folder)
    return path.resolve()


def detach_log_file() -> None:
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, LogFileHandler)]:
        root.removeHandler(old)
        old.close()


def log_file() -> Path | None:
    handler = next((h for h in logging.getLogger().handlers if isinstance(h, LogFileHandler)), None)
    return Path(handler.baseFilename) if handler else None


def _prune(folder: Path) -> None:
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in logs[KEEP_LOG_FILES:]:
        old.unlink(missing_ok=True)


def one_line(error: BaseException) -> str:
    """`error`'s message on one line, else its type's name. Lines are joined with "; ", or a space after a
    line that ends with ":" ("f.jsonl: 1 bad row(s) of 2: f.jsonl:2: invalid JSON ...; Fix the rows ...")."""
    text = ""
    for line in (ln.strip() for ln in str(error).splitlines() if ln.strip()):
        text += ("" if not text else " " if text.endswith(":") else "; ") + line
    return text or type(error).__name__


def report_failure(cause: str, error: BaseException | None = None) -> None:
    """Write `error`'s traceback to the log file, then print the log's path and, as the very last line, `cause`."""
    path = log_file()
    if error is not None:
        text = "".join(traceback.format_exception(error))
        if path is not None:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"--- the failure's traceback\n{text}")
    for handler in logging.getLogger().handlers:
        handler.flush()
    if path is not None:
        print(f"full log and traceback: {path}", file=sys.stderr)
    print(f"error: {cause}", file=sys.stderr, flush=True)
