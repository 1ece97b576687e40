"""The rows of every data file, checked when params are validated, so one report names every problem.

`row_problems(data)` streams the first `data.validate_rows` rows of each file the `data`
section names through the very checks preprocess applies (`stages.data.iter_rows`: JSON,
UTF-8, the format of each row, its fields, the kind a key takes, duplicate ids), and returns
each bad row as `(file:line, why)`, the same words preprocess would use. `check_rows(params)`,
what `load_params(..., rows=True)` calls, adds the reward gate's check of the held-out pairs
the counted rows will give (`stages.gates.held_out_pairs`). The params problems and these come
in one exit-2 message: a run whose data has a bad row and whose params have a problem of their
own is refused once, naming both.

What needs the model stays with preprocess: row lengths in tokens (`preprocess.max_length`)
and the chat template. With `data.on_bad_rows: skip` bad rows are not problems (preprocess
drops and counts them); a file with no usable row still is. Results are cached by path, size
and modification time, so the flow's second validation of the same files reads nothing.
"""
from __future__ import annotations

import functools
import logging

from stages.data import FORMATS, MAX_LISTED, LoadReport, iter_rows
from stages.data.formats import describe_formats
from stages.data.hub import DataSpec
from stages.data.io import DataError
from stages.data.sources import HELD_OUT_KEYS, data_files

ALL_ROWS = -1
log = logging.getLogger(__name__)


def check_rows(params) -> list[str]:
    """Every problem `load_params(..., rows=True)` adds: the bad rows (`row_problems`), and held-out preference
    pairs too few for the reward gate to ever pass (`stages.gates.held_out_pairs`); a warning is logged where
    they are few enough to make a pass unlikely."""
    problems, pairs, counted = row_problems(params.data)
    if (params.data.source or "").startswith("builtin:"):
        pairs += params.data.builtin.num_preference
    out = [f"{where} {why}" for where, why in problems]
    if counted and pairs:
        from stages.gates import held_out_pairs

        r = params.reward
        level, message = held_out_pairs(pairs, r.eval_fraction, min_accuracy=r.min_accuracy,
                                        confidence=r.gate_confidence)
        if level == "error":
            out.append(message)
        elif level == "warning":
            log.warning("%s", message)
    return out


def row_problems(data) -> tuple[list[tuple[str, str]], int, bool]:
    """([(where, why)] for every bad row in the first `data.validate_rows` rows of each data file (-1: all, 0:
    none), good preference pairs counted, whether every row of every file was read).

    `where` is `file:line` (or `file row N`, or the file alone for a file-level problem)."""
    limit = data.validate_rows
    if limit == 0:
        return [], 0, not data_files(data)
    problems, pairs, whole = [], 0, True
    for key, path in data_files(data):
        one_format = key in HELD_OUT_KEYS  # held-out files hold one format, as preprocess reads them
        kind = None if one_format else key.removeprefix("data.")
        if isinstance(path, DataSpec):  # read through `datasets` (its cache keys it by the files' content)
            found, n, read_all = _file_problems(path, kind, limit, data.on_bad_rows, -1, -1)
        elif not path.exists():  # missing_files reports it with its key
            whole = False
            continue
        else:
            stat = path.stat()
            found, n, read_all = _file_problems(str(path), kind, limit, data.on_bad_rows, stat.st_size,
                                                stat.st_mtime_ns)
        problems += found
        pairs += 0 if one_format else n
        whole &= read_all
    return problems, pairs, whole


@functools.lru_cache(maxsize=64)
def _file_problems(path: str | DataSpec, key: str | None, limit: int, on_bad_rows: str, size: int, mtime_ns: int
                   ) -> tuple[list[tuple[str, str]], int, bool]:
    """(problems, good preference rows, whether the whole file was read) of one file."""
    report = LoadReport(str(path))
    pairs = 0
    try:
        for fmt, _ in iter_rows(path, report, key=key, limit=None if limit == ALL_ROWS else limit):
            pairs += FORMATS[fmt][2] == "preference"
    except DataError as e:  # the file itself is unreadable: its message names it
        where, _, why = str(e).partition(": ")
        return [(f"{where}:", why)], 0, False
    whole = limit == ALL_ROWS or report.read < limit
    problems = []
    if on_bad_rows == "error":
        for example in report.examples:
            where, _, why = example.partition(": ")
            problems.append((f"{where}:", why))
        if report.invalid > MAX_LISTED:
            problems.append((f"{path}:", f"... and {report.invalid - MAX_LISTED} more bad row(s) in the first "
                                         f"{report.read}"))
        if problems:
            problems[-1] = (problems[-1][0], problems[-1][1] + "; fix the rows, or set data.on_bad_rows: skip to "
                            "drop them (they are counted in the manifest)")
            return problems, pairs, whole
    if not report.kept and whole:  # as preprocess says it (stages.data.check_report)
        problems.append((f"{path}:", f"no usable rows (read {report.read}); expected one of: {describe_formats()}"))
    return problems, pairs, whole
