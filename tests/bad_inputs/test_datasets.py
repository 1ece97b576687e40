"""Bad data files for `preprocess`: every format and failure mode, each named by file and line."""
from __future__ import annotations

import json
import re

import pytest

from tests.bad_inputs.conftest import assert_rejected, escape


def good(n: int = 30) -> list[dict]:
    return [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(n)]


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def with_row(line: int, bad, n: int = 30) -> bytes:
    """A good prompt/completion file whose 1-based `line` is `bad` (a row dict or raw bytes)."""
    rows: list = good(n)
    rows.insert(line - 1, bad)
    return jsonl(rows)


def msgs(*pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


# (case id, file name, content, patterns after "<file>" (the path is checked for every case)); given as data.sft
# (preference files as data.preference), whose rows must all be of that kind: data.source takes mixed files
CASES = [
    ("missing_column", "d.jsonl", with_row(3, {"prompt": "3+4="}),
     [r"d\.jsonl:3: row looks like format 'prompt_only' \(prompts data\) but data\.sft takes prompt_completion, "
      r"messages, alpaca, text rows; put prompts rows in data\.prompts"]),
    ("no_known_columns", "d.jsonl", jsonl([{"question": "1+1", "answer": "2"}] * 3),
     [r"d\.jsonl:1: fields \['answer', 'question'\] match no known format"]),
    ("extra_column", "d.jsonl", with_row(4, {"prompt": "a", "completion": "b", "label": True}),
     [r"d\.jsonl:4: row looks like format 'unpaired' \(unpaired data\) but data\.sft takes"]),
    ("wrong_type", "d.jsonl", with_row(2, {"prompt": "2+2=", "completion": 4}),
     [r"d\.jsonl:2: field 'completion' must be a string or a list of messages, got int"]),
    ("null_value", "d.jsonl", with_row(5, {"prompt": None, "completion": "x"}),
     [r"d\.jsonl:5: field 'prompt' must be a string or a list of messages, got NoneType"]),
    ("empty_string", "d.jsonl", with_row(7, {"prompt": "7+1=", "completion": ""}),
     [r"d\.jsonl:7: field 'completion' is empty"]),
    ("whitespace_only", "d.jsonl", with_row(8, {"prompt": "  \n ", "completion": "8"}),
     [r"d\.jsonl:8: field 'prompt' is empty"]),
    ("non_utf8_bytes", "d.jsonl", with_row(5, b'{"prompt": "caf\xe9", "completion": "x"}'),
     [r"d\.jsonl:5: not valid UTF-8 \(byte 0xe9 at column 16\)"]),
    ("invalid_json_line", "d.jsonl", with_row(6, b'{"prompt": "a", "completion": }'),
     [r"d\.jsonl:6: invalid JSON at column 31"]),
    # the line ends where its closing brace is missing: column 121 (just after the last character), not the
    # column 1 of the empty line after it where the parser ran out of input
    ("missing_closing_brace", "d.jsonl", with_row(5, b'{"prompt": "' + b"x" * 88 + b'", "completion": "y"'),
     [r"d\.jsonl:5: invalid JSON at column 121: Expecting ',' delimiter"]),
    ("utf8_bom_first_line", "d.jsonl", b"\xef\xbb\xbf" + with_row(2, {"prompt": "2+2=", "completion": 4}),
     [r"d\.jsonl:2: field 'completion' must be a string"]),  # the BOM is no error: line 2 is reported
    ("truncated_last_line", "d.jsonl", jsonl(good(10))[:-9],
     [r"d\.jsonl:10: invalid JSON at column"]),
    ("line_not_an_object", "d.jsonl", with_row(2, ["2+2=", "4"]),
     [r"d\.jsonl:2: expected a JSON object per line, got list"]),
    ("duplicate_ids", "d.jsonl", jsonl([{"id": i, **r} for i, r in enumerate(good(10))]
                                      + [{"id": 3, "prompt": "x", "completion": "y"}]),
     [r"d\.jsonl:11: id 3 is already used by \S*d\.jsonl:4 with other content"]),
    ("empty_file", "d.jsonl", b"", [r"d\.jsonl: no usable rows \(read 0\)"]),
    ("blank_lines_only", "d.jsonl", b"\n  \n\n", [r"d\.jsonl: no usable rows \(read 0\)"]),
    ("single_10mb_row", "d.jsonl", jsonl([{"prompt": "1+1=", "completion": "2 " * 5_000_000}]),
     [r"d\.jsonl: all 1 SFT row\(s\) are longer than preprocess\.max_length = 512 tokens"]),
    ("unsupported_suffix", "d.txt", b"prompt,completion\n", [r"d\.txt: unsupported file type '\.txt'"]),
    ("json_not_an_array", "d.json", b'{"prompt": "a", "completion": "b"}',
     [r"d\.json: expected a JSON array of row objects"]),
    ("json_syntax", "d.json", b'[{"prompt": "a",\n  "completion": }]', [r"d\.json:2: invalid JSON at column 17"]),
    ("json_non_utf8", "d.json", b'[{"prompt": "\xff", "completion": "b"}]', [r"d\.json: not valid UTF-8 at byte 13"]),
    ("json_row_not_object", "d.json", json.dumps([good(1)[0], "oops", *good(5)]).encode(),
     [r"d\.json row 1: row is not a JSON object"]),
    ("csv_unknown_columns", "d.csv", b"q,a\n1+1,2\n", [r"d\.csv:2: fields \['a', 'q'\] match no known format"]),
    ("csv_non_utf8", "d.csv", b"prompt,completion\ncaf\xe9,x\n", [r"d\.csv: not valid UTF-8 at byte"]),
    ("csv_empty_cell", "d.csv", b"prompt,completion\n1+1=,2\n2+2=,\n",
     [r"d\.csv:3: field 'completion' must be a string"]),
    ("messages_bad_role", "d.jsonl", jsonl([{"messages": msgs(("user", "1+1"), ("assistant", "2"))}] * 3
                                           + [{"messages": msgs(("bot", "hi"), ("assistant", "2"))}]),
     [r"d\.jsonl:4: field 'messages\[0\]\.role' = 'bot': expected one of system, user"]),
    ("messages_end_with_user", "d.jsonl", jsonl([{"messages": msgs(("user", "1+1"), ("assistant", "2"))}] * 3
                                                + [{"messages": msgs(("user", "1+1"), ("user", "?"))}]),
     [r"d\.jsonl:4: field 'messages' must end with a message of role 'assistant'"]),
    ("messages_missing_content", "d.jsonl",
     jsonl([{"messages": [{"role": "user"}, {"role": "assistant", "content": "2"}]}]),
     [r"d\.jsonl:1: field 'messages\[0\]' must be an object with 'role' and 'content'"]),
    ("preference_mixed_forms", "p.jsonl", jsonl([{"prompt": "q", "chosen": msgs(("assistant", "a")), "rejected": "b"}]),
     [r"p\.jsonl:1: fields prompt, chosen, rejected mix plain strings and message lists"]),
    ("preference_missing_rejected", "p.jsonl", jsonl([{"prompt": "q", "chosen": "a", "rejected": "b"}] * 2
                                                     + [{"prompt": "q", "chosen": "a"}]),
     [r"p\.jsonl:3: row looks like format 'prompt_only' \(prompts data\) but data\.preference takes preference, "
      r"unpaired rows"]),
    ("unpaired_label_not_bool", "p.jsonl", jsonl([{"prompt": "q", "completion": "a", "label": "yes"}]),
     [r"p\.jsonl:1: field 'label' must be true or false, got 'yes'"]),
    ("alpaca_empty_instruction", "d.jsonl", jsonl([{"instruction": "", "output": "x"}]),
     [r"d\.jsonl:1: field 'instruction' must be a non-empty string"]),
]


# what only preprocess can check: lengths in tokens need the model's tokenizer
NEEDS_THE_TOKENIZER = {"single_10mb_row"}
# cases whose readable rows are SFT rows only: with the default reward functions (which name the reward model)
# params validation also reports that no preference data trains one
SFT_ROWS_ONLY = {"missing_column", "extra_column", "wrong_type", "null_value", "empty_string", "whitespace_only",
                 "non_utf8_bytes", "invalid_json_line", "missing_closing_brace", "utf8_bom_first_line",
                 "truncated_last_line", "line_not_an_object", "duplicate_ids", "json_row_not_object", "csv_empty_cell",
                 "messages_bad_role", "messages_end_with_user", "messages_missing_content", "unpaired_label_not_bool",
                 "alpaca_empty_instruction"}
REWARD_PROBLEM = (r"score\.reward_functions = \['exact_match', 'reward_model_prob'\] includes reward_model_prob, "
                  r"but there is no preference data to train one: set --set policy\.method=grpo --set "
                  r"score\.enabled=false \(GRPO learns from the rule reward on every sample\)")


@pytest.mark.parametrize("validate_rows", [100_000, 0], ids=["at_validation", "in_preprocess"])
@pytest.mark.parametrize("case, name, content, patterns", CASES, ids=[c[0] for c in CASES])
def test_bad_data_file(capsys, tmp_path, params_for, case, name, content, patterns, validate_rows):
    """The same message whoever finds the row: params validation (exit 2, before anything is built) or, with
    data.validate_rows = 0 or for what needs the tokenizer, preprocess (exit 1)."""
    data = tmp_path / name
    data.write_bytes(content)
    key = "preference" if name.startswith("p.") else "sft"
    params = params_for({"data": {"source": None, key: str(data), "validate_rows": validate_rows}})
    at_validation = validate_rows != 0 and case not in NEEDS_THE_TOKENIZER
    assert_rejected(capsys, params, "preprocess", escape(data), *patterns, code=2 if at_validation else 1)
    if at_validation:
        assert not (tmp_path / "artifacts").exists()  # not even the model was built


@pytest.mark.parametrize("case, name, content, patterns", [c for c in CASES if c[0] not in NEEDS_THE_TOKENIZER],
                         ids=[c[0] for c in CASES if c[0] not in NEEDS_THE_TOKENIZER])
def test_bad_row_and_params_problem_in_one_report(capsys, tmp_path, params_for, case, name, content, patterns):
    """With the default reward functions, a bad row and the params problem are named in the same exit-2 message:
    one run tells the user everything to fix."""
    data = tmp_path / name
    data.write_bytes(content)
    key = "preference" if name.startswith("p.") else "sft"
    params = params_for({"data": {"source": None, key: str(data)},
                         "score": {"reward_functions": ["exact_match", "reward_model_prob"],
                                   "reward_weights": [1.0, 0.5]}})
    err = assert_rejected(capsys, params, "preprocess", escape(data), *patterns, code=2)
    assert bool(re.search(REWARD_PROBLEM, err)) == (case in SFT_ROWS_ONLY), err
    print(f"\n[{case}]\n" + "\n".join(err.rstrip().splitlines()[-3:]))


def test_parquet_wrong_type(capsys, tmp_path, params_for):
    import pandas as pd

    data = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "completion": [2, 4]}).to_parquet(data)
    params = params_for({"data": {"source": str(data)}})
    assert_rejected(capsys, params, "preprocess", escape(data) + r" row 0: field 'completion' must be a string", code=2)


def test_not_a_saved_dataset_folder(capsys, tmp_path, params_for):
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "notes.bin").write_bytes(b"not a dataset")  # no file `datasets` reads (a .txt would be text rows)
    params = params_for({"data": {"source": str(folder)}})
    assert_rejected(capsys, params, "preprocess", r"data\.source = '" + escape(folder) + r"': the folder "
                    + escape(folder) + r" holds no data file, only notes\.bin\. Put the rows in it as \.jsonl", code=2)


@pytest.mark.parametrize("key", ["source", "sft", "preference", "prompts", "eval_source"])
def test_missing_data_file_stops_at_params_validation(capsys, tmp_path, params_for, key):
    """Named with its key before anything is built (exit 2: a params problem), not by preprocess."""
    extra = {"data": {key: str(tmp_path / "nope.jsonl")}}
    if key in ("sft", "preference", "prompts"):
        extra["data"]["source"] = None
    params = params_for(extra)
    assert_rejected(capsys, params, "preprocess", rf"data\.{key} = '" + escape(tmp_path / "nope.jsonl")
                          + r"': no such file or folder", code=2)
    assert not (tmp_path / "artifacts").exists()  # not even the model was built


def test_eval_source_without_references(capsys, tmp_path, params_for):
    (tmp_path / "train.jsonl").write_bytes(jsonl(good()))
    (tmp_path / "eval.jsonl").write_bytes(jsonl([{"prompt": "q", "chosen": "a", "rejected": "b"}]))
    params = params_for({"data": {"source": str(tmp_path / "train.jsonl"),
                                  "eval_source": str(tmp_path / "eval.jsonl")}})
    assert_rejected(capsys, params, "preprocess", r"data\.eval_source = " + escape(tmp_path / "eval.jsonl")
                    + r": format 'preference' has no reference answer", code=1)


def test_skip_mode_with_every_row_bad(capsys, tmp_path, params_for):
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"prompt": "a", "completion": 1}] * 4))
    params = params_for({"data": {"source": str(tmp_path / "d.jsonl"), "on_bad_rows": "skip"}})
    assert_rejected(capsys, params, "preprocess", escape(tmp_path / "d.jsonl") + r": no usable rows \(read 4\)", code=2)


def test_streaming_mode_names_the_line_too(capsys, tmp_path, params_for):
    data = tmp_path / "d.jsonl"
    data.write_bytes(with_row(9, b'{"prompt": "a" "completion": "b"}'))
    params = params_for({"data": {"source": str(data)}, "preprocess": {"streaming": True}})
    assert_rejected(capsys, params, "preprocess", escape(data) + r":9: invalid JSON at column 16", code=2)


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"{i}+2=", "chosen": str(i + 2), "rejected": str(i + 3)} for i in range(n)]


def test_too_few_held_out_pairs_for_the_reward_gate_stop_before_sft(capsys, tmp_path, params_for):
    """70 pairs hold out 7 at reward.eval_fraction 0.1: fewer than the 25 on which the gate (0.9 at 95%) can pass
    even if every pair is ranked right. Refused at validation, naming the key and the value that would do."""
    (tmp_path / "sft.jsonl").write_bytes(jsonl(good(100)))
    (tmp_path / "pairs.jsonl").write_bytes(jsonl(pairs(70)))
    params = params_for({"data": {"source": None, "sft": str(tmp_path / "sft.jsonl"),
                                  "preference": str(tmp_path / "pairs.jsonl")}, "reward": {"min_accuracy": 0.9}})
    assert_rejected(capsys, params, "preprocess", r"reward\.eval_fraction = 0\.1: 70 preference pairs leave about 7 "
                    r"held out, fewer than the 25 on which the reward gate \(reward\.min_accuracy = 0\.9 at "
                    r"reward\.gate_confidence = 0\.95\) can pass even if every one is ranked right: the run would "
                    r"stop after SFT; raise reward\.eval_fraction \(now 0\.1; 0\.36 holds out 25\)", code=2)
    assert not (tmp_path / "artifacts").exists()


def test_few_held_out_pairs_are_warned_about(caplog, tmp_path, params_for):
    """300 pairs hold out 30: the gate can pass, but a reward model right on 95% of them would not; a warning
    with the key, and the run goes on."""
    from stages.harness.params_loader import load_params

    (tmp_path / "sft.jsonl").write_bytes(jsonl(good(100)))
    (tmp_path / "pairs.jsonl").write_bytes(jsonl(pairs(300)))
    params = params_for({"data": {"source": None, "sft": str(tmp_path / "sft.jsonl"),
                                  "preference": str(tmp_path / "pairs.jsonl")}, "reward": {"min_accuracy": 0.9}})
    with caplog.at_level("WARNING"):
        load_params(params, rows=True)
    assert ("reward: about 30 held-out preference pairs (reward.eval_fraction = 0.1 of 300): a reward model right on "
            "95% of them would still fail the gate") in caplog.text and "raise reward.eval_fraction" in caplog.text
