"""Data utilities: reading local files, detecting and validating formats, normalising rows.

`load_source(path, on_bad_rows=..., key=...)` is the entry point preprocess uses: it
returns the file's rows in canonical form grouped by destination (sft, preference,
unpaired, prompts), and a report counting every row it read, kept or rejected (with the
first reasons, each naming the file and line). Which files a run reads and what the
chosen methods need from them: `stages.data.sources`.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.data.formats import FORMATS, describe_formats, detect_format, is_conversational, normalise, validate
from stages.data.hub import DataSpec
from stages.data.hub import read_rows as read_spec_rows
from stages.data.io import DataError, read_jsonl, read_rows, write_jsonl
from stages.data.templates import apply_chat_template, maybe_extract_prompt, unpair_preference_dataset

__all__ = ["DataError", "LoadReport", "load_source", "load_grouped", "iter_rows", "iter_source", "check_report",
           "is_conversational", "read_jsonl", "write_jsonl", "FORMATS", "apply_chat_template", "maybe_extract_prompt",
           "unpair_preference_dataset", "pack_dataset"]


def __getattr__(name: str):  # packing imports numpy: loaded on first use, so params validation stays light
    if name == "pack_dataset":
        from stages.data.packing import pack_dataset

        return pack_dataset
    raise AttributeError(f"module 'stages.data' has no attribute {name!r}")
# not re-exported: stages.data.collators.CompletionCollator, which needs torch (importing stages.data stays light)

MAX_LISTED = 20


@dataclass
class LoadReport:
    source: str
    format: str = ""  # the first row's format
    formats: dict[str, int] = field(default_factory=dict)  # rows kept per format (several in a mixed file)
    read: int = 0
    kept: int = 0
    invalid: int = 0
    examples: list[str] = field(default_factory=list)  # "file:line: why", the first MAX_LISTED

    def reject(self, where: str, why: str) -> None:
        self.invalid += 1
        if len(self.examples) < MAX_LISTED:
            self.examples.append(f"{where}: {why}")

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "format": self.format, "formats": self.formats, "read": self.read,
                "kept": self.kept,
                "invalid": self.invalid, "invalid_examples": self.examples}


def iter_rows(path: str | Path | DataSpec, report: LoadReport, *, key: str | None = None,
              limit: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(format, canonical row) of every good row of a file, or of a DataSpec read through `datasets`
    (stages.data.hub), one at a time (constant memory for .jsonl).

    `key`: the data params key naming the file ("source", "sft", "preference", "prompts"):
    data.source takes rows of any format (a mixed file), the others only their own kind
    (`stages.data.sources.ACCEPTS`). None: one format per file, that of the first row.
    Bad rows go to `report`; a row whose `id` another row with other content already used is one.
    `limit`: read only the first `limit` rows (params validation's cap, `data.validate_rows`).
    """
    from stages.data.sources import destination_problem

    fmt = None
    ids: dict[Any, tuple[str, str]] = {}  # id -> (where first seen, content hash)
    for row in itertools.islice(read_spec_rows(path) if isinstance(path, DataSpec) else read_rows(path), limit):
        report.read += 1
        if row.value is None:
            report.reject(row.where, row.error)
            continue
        row_fmt = detect_format(row.value)
        if row_fmt is None:
            report.reject(row.where, f"fields {sorted(row.value)} match no known format ({describe_formats()})")
            continue
        if fmt is None:
            fmt = report.format = row_fmt
        wrong = (destination_problem(key, row_fmt) if key is not None else
                 f"row looks like format {row_fmt!r} but this file's first row is {fmt!r}; one format per file"
                 if row_fmt != fmt else "")
        why = wrong or validate(row_fmt, row.value) or _duplicate_id(ids, row.where, row.value)
        if why:
            report.reject(row.where, why)
            continue
        report.kept += 1
        report.formats[row_fmt] = report.formats.get(row_fmt, 0) + 1
        yield row_fmt, normalise(row_fmt, row.value)


def iter_source(path: str | Path, report: LoadReport) -> Iterator[dict[str, Any]]:
    """Canonical rows of a one-format file (see `iter_rows` with key None); `report.format` is its format."""
    for _, row in iter_rows(path, report):
        yield row


def _duplicate_id(ids: dict, where: str, row: dict[str, Any]) -> str:
    """'' unless the row's `id` was already used by a row with other content (exact duplicates are left to dedup)."""
    if "id" not in row or not isinstance(row["id"], (str, int)):
        return ""
    digest = hashlib.sha1(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()
    first = ids.setdefault(row["id"], (where, digest))
    if first[1] == digest:
        return ""
    return f"id {row['id']!r} is already used by {first[0]} with other content; ids must be unique"


def check_report(report: LoadReport, on_bad_rows: str) -> None:
    """Raise DataError listing the bad rows (on_bad_rows="error"), or when nothing usable was read."""
    if report.invalid and on_bad_rows == "error":
        listed = "\n  ".join(report.examples)
        more = f"\n  ... and {report.invalid - len(report.examples)} more" if report.invalid > MAX_LISTED else ""
        raise DataError(f"{report.source}: {report.invalid} bad row(s) of {report.read}:\n  {listed}{more}\n"
                        "Fix the rows, or set data.on_bad_rows: skip to drop them (they are counted in the manifest).")
    if not report.kept:
        raise DataError(f"{report.source}: no usable rows (read {report.read}); expected one of: {describe_formats()}")


def load_source(path: str | Path, *, on_bad_rows: str = "error") -> tuple[str, list[dict[str, Any]], LoadReport]:
    """(format, canonical rows, report) of a one-format file. With on_bad_rows="error" any bad row raises
    DataError listing them."""
    report = LoadReport(str(path))
    rows = list(iter_source(path, report))
    check_report(report, on_bad_rows)
    return report.format, rows, report


def load_grouped(path: str | Path, *, key: str, on_bad_rows: str = "error"
                 ) -> tuple[dict[str, list[dict[str, Any]]], LoadReport]:
    """({destination: canonical rows}, report) of the file data params key `key` names (see `iter_rows`)."""
    report = LoadReport(str(path))
    groups: dict[str, list[dict[str, Any]]] = {}
    for fmt, row in iter_rows(path, report, key=key):
        groups.setdefault(FORMATS[fmt][2], []).append(row)
    check_report(report, on_bad_rows)
    return groups, report
