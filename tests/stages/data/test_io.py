"""JSON errors point at the right line and column, in .jsonl rows, .json files and internal .jsonl reads."""
from __future__ import annotations

import json

import pytest

from stages.data import DataError, LoadReport, iter_rows, read_jsonl
from stages.data.io import json_error_position, read_rows

LINE = json.dumps({"prompt": "x" * 88, "completion": "y"})  # 121 characters; 120 without its "}"


@pytest.mark.parametrize("text, expected", [
    (LINE[:-1], (1, 121)),                 # missing "}": just after the last character, not line 2 column 1
    (LINE[:-1] + "\n", (1, 121)),          # a trailing newline changes nothing
    (LINE[:-1] + ',}', (1, 122)),          # trailing comma: where the property name should be
    ('{"a": 1 "b": 2}', (1, 9)),           # missing comma: at the second key
    ('[\n  {"a": 1},\n  {"b": }\n]', (3, 9)),  # inside a pretty-printed file: line and column of the value
])
def test_json_error_position(text, expected):
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    assert json_error_position(text, e.value) == expected


def test_jsonl_row_missing_its_closing_brace_reports_the_end_of_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(LINE + "\n" + LINE[:-1] + "\n" + LINE + "\n")
    rows = list(read_rows(path))
    assert rows[1].where == f"{path}:2" and rows[1].error == "invalid JSON at column 121: Expecting ',' delimiter"
    assert rows[0].value is not None and rows[2].value is not None


def test_json_file_error_names_line_and_column(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "a", "completion": }\n]\n')
    with pytest.raises(DataError, match=r"d\.json:3: invalid JSON at column 33: Expecting value"):
        list(read_rows(path))


def test_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + LINE.encode() + b"\n")
    report = LoadReport(str(path))
    assert [fmt for fmt, _ in iter_rows(path, report)] == ["prompt_completion"] and report.invalid == 0
    assert read_jsonl(path)[0]["completion"] == "y"


def test_read_jsonl_names_file_line_and_column(tmp_path):
    path = tmp_path / "gens.jsonl"
    path.write_text(LINE + "\n\n" + LINE[:-1] + "\n")
    with pytest.raises(DataError, match=r"gens\.jsonl:3: invalid JSON at column 121"):
        read_jsonl(path)
