"""Reading rows from local files, with errors that name the file and the line or row.

Supported: `.jsonl` (one JSON object per line), `.json` (an array of objects), `.parquet`,
`.csv`, and folders written by `datasets.Dataset.save_to_disk` (a DatasetDict's `train`
split). Every row comes back with its location ("data.jsonl:17") so later validation
errors can point at it too.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A problem with an input file; the message names the file and the line/row."""


@dataclass
class Row:
    where: str  # "path:line" or "path row N"
    value: dict[str, Any] | None  # None when the row could not be parsed
    error: str = ""  # why it could not be parsed


SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def read_rows(path: str | Path) -> Iterator[Row]:
    """Yield every row of a local data file or `save_to_disk` folder; parse errors come back as rows with `error`."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or folder (data.source takes a local file, a save_to_disk folder "
                        "or builtin:arithmetic)")
    if path.is_dir():
        yield from _read_saved(path)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix in (".parquet", ".csv"):
        yield from _read_table(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)} "
                        "or a datasets.save_to_disk folder")


def json_error_position(text: str, e: json.JSONDecodeError) -> tuple[int, int]:
    """(line, column), both 1-based, where the JSON in `text` goes wrong.

    Where the parser ran out of input (a missing closing brace or quote), that is just after
    the last non-blank character, not the start of the next (empty) line as `e.lineno` /
    `e.colno` have it: a line missing its final `}` at column 121 reports column 121, not 1.
    """
    pos = e.pos
    if not text[pos:].strip():
        pos = len(text.rstrip())
    line_start = text.rfind("\n", 0, pos) + 1
    return text.count("\n", 0, pos) + 1, pos - line_start + 1


def _read_jsonl(path: Path) -> Iterator[Row]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                # a byte-order mark (Windows editors) is not part of the first row
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield Row(where, None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                       "re-encode the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                yield Row(where, None, f"invalid JSON at column {json_error_position(text, e)[1]}: {e.msg}")
                continue
            if not isinstance(value, dict):
                yield Row(where, None, f"expected a JSON object per line, got {type(value).__name__}")
                continue
            yield Row(where, value)


def _read_json(path: Path) -> Iterator[Row]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte {e.start}; re-encode the file as UTF-8") from None
    except json.JSONDecodeError as e:
        line, column = json_error_position(text, e)
        raise DataError(f"{path}:{line}: invalid JSON at column {column}: {e.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of row objects (or {{\"data\": [...]}}); "
                        "for one object per line use .jsonl")
    for i, value in enumerate(data):
        where = f"{path} row {i}"
        yield Row(where, value) if isinstance(value, dict) else Row(where, None, "row is not a JSON object")


def _read_table(path: Path) -> Iterator[Row]:
    import pandas as pd

    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path, encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte {e.start}; re-encode the file as UTF-8") from None
    except Exception as e:  # pandas/pyarrow raise many types for a malformed file
        raise DataError(f"{path}: cannot read as {path.suffix[1:]}: {e}") from None
    offset = 2 if path.suffix == ".csv" else 0  # csv: 1-based line numbers after the header
    for i, record in enumerate(frame.to_dict(orient="records")):
        where = f"{path}:{i + offset}" if offset else f"{path} row {i}"
        yield Row(where, {k: _plain(v) for k, v in record.items()})


def _read_saved(path: Path) -> Iterator[Row]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a datasets.save_to_disk folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: DatasetDict without a 'train' split (has {', '.join(ds)})")
        ds = ds["train"]
    for i, record in enumerate(ds):
        yield Row(f"{path} row {i}", {k: _plain(v) for k, v in record.items()})


def _plain(value: Any) -> Any:
    """numpy/pandas scalars and arrays -> plain Python (NaN -> None)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a .jsonl file; a line that is not JSON raises DataError naming the file, line and column."""
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON at column {json_error_position(line, e)[1]}: "
                                f"{e.msg}") from None
    return rows
