"""Row checks at params validation: the cap, skip mode, held-out files, and status reading no rows."""
from __future__ import annotations

import json
import time

import pytest

from stages.data import row_checks
from stages.harness.config import DataConfig
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import write_params


def rows_file(path, n: int, bad: dict[int, str]):
    """`n` prompt/completion rows, the 1-based lines in `bad` replaced by their text."""
    lines = [bad.get(i, json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)})) for i in range(1, n + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def bad(data_config: DataConfig) -> list[tuple[str, str]]:
    return row_checks.row_problems(data_config)[0]


def data(**kw) -> DataConfig:
    return DataConfig(**{"source": None, **kw})


def test_the_cap_counts_rows_from_the_top(tmp_path):
    f = rows_file(tmp_path / "d.jsonl", 50, {10: '{"prompt": "x"', 40: '{"prompt": "x", "completion": ""}'})
    assert bad(data(sft=str(f), validate_rows=20)) == [
        (f"{f}:10:", "invalid JSON at column 15: Expecting ',' delimiter; fix the rows, or set data.on_bad_rows: "
                     "skip to drop them (they are counted in the manifest)")]
    assert [w for w, _ in bad(data(sft=str(f), validate_rows=-1))] == [f"{f}:10:", f"{f}:40:"]
    assert bad(data(sft=str(f), validate_rows=0)) == []


def test_skip_mode_reports_only_a_file_with_no_usable_row(tmp_path):
    some = rows_file(tmp_path / "some.jsonl", 5, {2: "{"})
    assert bad(data(sft=str(some), on_bad_rows="skip")) == []
    none = rows_file(tmp_path / "none.jsonl", 2, {1: "{", 2: "["})
    assert bad(data(sft=str(none), on_bad_rows="skip"))[0][1].startswith("no usable rows (read 2)")


def test_more_than_twenty_bad_rows_are_counted(tmp_path):
    f = rows_file(tmp_path / "d.jsonl", 30, {i: "{" for i in range(1, 26)})
    problems = bad(data(sft=str(f)))
    assert len(problems) == 21 and problems[-1][1].startswith("... and 5 more bad row(s) in the first 30")


def test_held_out_files_hold_one_format(tmp_path):
    train = rows_file(tmp_path / "t.jsonl", 5, {})
    held = rows_file(tmp_path / "e.jsonl", 3, {3: json.dumps({"text": "x"})})
    assert bad(data(sft=str(train), eval_source=str(held))) == [
        (f"{held}:3:", "row looks like format 'text' but this file's first row is 'prompt_completion'; one format "
                       "per file; fix the rows, or set data.on_bad_rows: skip to drop them (they are counted in the "
                       "manifest)")]


def test_a_changed_file_is_read_again(tmp_path):
    f = rows_file(tmp_path / "d.jsonl", 5, {})
    assert bad(data(sft=str(f))) == []
    time.sleep(0.01)
    rows_file(f, 5, {3: "{"})
    assert bad(data(sft=str(f)))[0][0] == f"{f}:3:"


def test_only_entries_that_start_a_run_read_rows(tmp_path):
    """load_params(rows=False), what `status` and launched ranks use, reads no row; rows=True reports it."""
    f = rows_file(tmp_path / "d.jsonl", 5, {2: '{"prompt": "x", "completion": 3}'})
    params = write_params(tmp_path, {"data": {"source": None, "sft": str(f)},
                                     "score": {"reward_functions": ["exact_match"], "reward_weights": None}})
    load_params(params)
    with pytest.raises(ParamsError, match=rf"{f}:2: field 'completion' must be a string"):
        load_params(params, rows=True)


def test_validate_rows_range(tmp_path):
    with pytest.raises(ParamsError, match=r"data\.validate_rows = -2: must be -1 \(all rows\), 0 \(off\) or a row "
                                          r"count"):
        load_params(write_params(tmp_path), ["data.validate_rows=-2"])


def test_pairs_are_counted_for_the_reward_gate(tmp_path):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(9))
                     + '{"prompt": "x"\n')
    problems, n, whole = row_checks.row_problems(data(preference=str(pairs), on_bad_rows="skip"))
    assert (problems, n, whole) == ([], 9, True)
    assert row_checks.row_problems(data(preference=str(pairs), validate_rows=5, on_bad_rows="skip"))[1:] == (5, False)
