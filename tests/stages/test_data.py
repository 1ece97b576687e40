"""Reading, validating and normalising real data files; every bad row is named, never silently dropped."""
import json

import pandas as pd
import pytest

from stages.data import DataError, load_source

GOOD = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"},
                  {"role": "assistant", "content": "4"}]},
]


def _jsonl(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def test_messages_become_prompt_completion(tmp_path):
    fmt, rows, report = load_source(_jsonl(tmp_path / "d.jsonl", GOOD))
    assert fmt == "messages" and report.kept == 2 and report.invalid == 0
    assert rows[1]["prompt"][-1] == {"role": "user", "content": "2+2"}
    assert rows[1]["completion"] == [{"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("bad, needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "must end with a message of role 'assistant'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "'messages[0].content' must be a string"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "x"}]}, "expected one of"),
    (b'{"messages": [', "invalid JSON at column"),
    (b'{"messages": "caf\xe9"}', "not valid UTF-8 (byte 0xe9"),
    ({"foo": 1}, "match no known format"),
    ({"prompt": "q", "completion": "a"}, "one format per file"),
])
def test_bad_row_named_by_file_and_line(tmp_path, bad, needle):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.raises(DataError) as e:
        load_source(path)
    assert f"{path}:2: " in str(e.value) and needle in str(e.value)
    assert "on_bad_rows: skip" in str(e.value)


def test_skip_mode_counts_every_bad_row(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [GOOD[0], b"{oops", {"prompt": "", "completion": "x"}, GOOD[1]])
    fmt, rows, report = load_source(path, on_bad_rows="skip")
    assert len(rows) == 2 and report.read == 4 and report.invalid == 2
    assert report.examples[0].startswith(f"{path}:2: invalid JSON")


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "", "completion": "a"}, "field 'prompt' is empty"),
    ({"prompt": "q", "completion": 5}, "field 'completion' must be a string or a list of messages"),
    ({"prompt": "q", "chosen": "a", "rejected": ["x"]}, r"field 'rejected\[0\]' must be an object"),
    ({"prompt": "q", "completion": "a", "label": "yes"}, "field 'label' must be true or false"),
    ({"instruction": " ", "output": "o"}, "field 'instruction' must be a non-empty string"),
])
def test_field_level_errors(tmp_path, row, needle):
    with pytest.raises(DataError, match=needle):
        load_source(_jsonl(tmp_path / "d.jsonl", [row]))


def test_alpaca_and_preference_without_prompt(tmp_path):
    fmt, rows, _ = load_source(_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add", "input": "2+2", "output": "4"}]))
    assert fmt == "alpaca" and rows[0]["prompt"] == [{"role": "user", "content": "Add\n\n2+2"}]
    conv = [{"role": "user", "content": "q"}]
    pref = {"chosen": conv + [{"role": "assistant", "content": "good"}],
            "rejected": conv + [{"role": "assistant", "content": "bad"}]}
    fmt, rows, _ = load_source(_jsonl(tmp_path / "p.jsonl", [pref]))
    assert fmt == "preference" and rows[0]["prompt"] == conv
    assert rows[0]["chosen"] == [{"role": "assistant", "content": "good"}]


def test_csv_parquet_json_and_save_to_disk(tmp_path):
    import datasets

    frame = pd.DataFrame({"prompt": ["1+1", "2+2", ""], "completion": ["2", "4", "x"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    with pytest.raises(DataError, match=rf"{tmp_path / 'd.csv'}:4: field 'prompt'"):
        load_source(tmp_path / "d.csv")  # csv line 4 = header + third row
    frame.iloc[:2].to_parquet(tmp_path / "d.parquet")
    assert load_source(tmp_path / "d.parquet")[2].kept == 2
    (tmp_path / "d.json").write_text(json.dumps([{"text": "hello"}, {"text": "world"}]))
    assert load_source(tmp_path / "d.json")[0] == "text"
    datasets.Dataset.from_pandas(frame.iloc[:2]).save_to_disk(str(tmp_path / "saved"))
    fmt, rows, _ = load_source(tmp_path / "saved")
    assert fmt == "prompt_completion" and rows[1] == {"prompt": "2+2", "completion": "4"}


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_source(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        load_source(tmp_path / "d.txt")
