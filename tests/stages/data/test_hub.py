"""Data keys as the ecosystem ships datasets (stages.data.hub): hub-layout folders, globs, slices, column maps and
hub ids from the local Hugging Face cache, against the same rows given as .jsonl; and the bad inputs, each found
at params validation (before any model is built)."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from stages.data import load_grouped, load_source
from stages.data.hub import DataSpec, rows_hash, source_identity, spec_of
from stages.harness import runner
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import write_params
from tests.pipelines import hub_layout_folder, write_jsonl

TRAIN = [{"prompt": f"What is {i}+1?", "completion": str(i + 1), **({"id": i} if i % 3 else {})} for i in range(30)]
TEST = [{"prompt": f"What is {i}+2?", "completion": str(i + 2)} for i in range(8)]
QA = {"prompt": "question", "completion": "answer"}  # how the hub folder names the columns
COLUMNS = {"question": "prompt", "answer": "completion"}  # the column map back
SCORE = {"score": {"reward_functions": ["exact_match"], "reward_weights": None}}  # sft data only: no reward model


@pytest.fixture(autouse=True)
def _own_caches(tmp_path, monkeypatch):
    """datasets' Arrow cache and the hub's file cache in the test's folder, the hub turned off."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def folder(tmp_path) -> Path:
    return hub_layout_folder(tmp_path / "qa", {"train": TRAIN, "test": TEST}, {"train": 2}, rename=QA)


def hub_cache_entry(tmp_path: Path, repo_id: str, commit: str = "c0ffee" * 6 + "0123") -> Path:
    """A dataset in the hub cache's layout, as `hf download --repo-type dataset` leaves it:
    datasets--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = tmp_path / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    hub_layout_folder(repo / "snapshots" / commit, {"train": TRAIN, "test": TEST}, {"train": 3}, rename=QA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo


def mapping(path, **kw) -> dict:
    return {"path": str(path), "columns": COLUMNS, **kw}


def test_hub_layout_folder_gives_the_jsonl_rows_and_their_hash(tmp_path, folder):
    jsonl = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    spec = spec_of("data.sft", mapping(folder))
    assert (spec.split, dict(spec.columns)) == ("train", COLUMNS)
    groups, report = load_grouped(spec, key="sft")
    assert groups == load_grouped(jsonl, key="sft")[0]
    assert groups["sft"] == TRAIN and report.kept == 30  # shard order kept; rows without an id have none (not null)
    assert rows_hash("data.sft", mapping(folder)) == rows_hash("data.sft", str(jsonl))
    fmt, rows, _ = load_source(spec_of("data.eval_source", mapping(folder, split="test")))
    assert (fmt, rows) == ("prompt_completion", TEST)


def test_slices_globs_and_save_to_disk_folders(tmp_path, folder):
    import datasets

    first = load_source(spec_of("data.sft", mapping(folder, split="train[:50%]")))[1]
    assert first == TRAIN[:15]
    assert load_source(spec_of("data.sft", mapping(folder, split="train[-5:]")))[1] == TRAIN[-5:]
    shards = load_source(spec_of("data.sft", mapping(folder / "data" / "train-*.parquet")))[1]
    assert shards == TRAIN
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN), "test": datasets.Dataset.from_list(TEST)}) \
        .save_to_disk(str(saved))
    assert load_source(spec_of("data.sft", {"path": str(saved), "split": "test[:3]"}))[1] == TEST[:3]


def test_preprocess_fingerprint_equals_the_jsonl_versions_and_a_shard_edit_makes_it_stale(tmp_path, folder):
    jsonl = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    for name in "abc":
        (tmp_path / name).mkdir()
    as_jsonl = load_params(write_params(tmp_path / "a", {"data": {"source": None, "sft": str(jsonl)}, **SCORE}))
    as_hub = load_params(write_params(tmp_path / "b", {"data": {"source": None, "sft": mapping(folder)}, **SCORE}))
    assert runner.inspect("preprocess", as_hub).fingerprint == runner.inspect("preprocess", as_jsonl).fingerprint
    other = load_params(write_params(tmp_path / "c", {"data": {"source": None,
                                                               "sft": mapping(folder, split="train[:90%]")}, **SCORE}))
    assert runner.inspect("preprocess", other).fingerprint != runner.inspect("preprocess", as_jsonl).fingerprint

    built = runner.run_stage("preprocess", as_hub)
    assert built["executed"] and built["metrics"]["rows"]["eval"] > 0
    assert runner.status(as_hub)[0] == {"stage": "preprocess", "current": True, "reason": "",
                                        "fingerprint": built["fingerprint"]}
    edited = [dict(r) for r in TRAIN[15:]]
    edited[0]["completion"] = "sixteen"
    hub_layout_folder(tmp_path / "edit", {"train": edited}, rename=QA)
    (tmp_path / "edit" / "data" / "train-00000-of-00001.parquet").replace(
        folder / "data" / "train-00001-of-00002.parquet")  # one shard of two rewritten
    state = runner.status(as_hub)[0]
    assert not state["current"] and state["reason"].startswith("stale") and state["fingerprint"] != built["fingerprint"]
    assert runner.run_stage("preprocess", as_hub)["executed"]


def test_hub_id_from_a_cache_entry_offline(tmp_path):
    repo = hub_cache_entry(tmp_path, "org/qa")
    params = load_params(write_params(tmp_path, {"data": {"source": None, "sft": mapping("org/qa", split="train"),
                                                          "eval_source": mapping("org/qa", split="test")}, **SCORE}))
    spec = spec_of("data.eval_source", params.data.eval_source)
    assert load_source(spec)[1] == TEST
    twin = str(write_jsonl(tmp_path / "t.jsonl", TRAIN))
    assert rows_hash("data.sft", params.data.sft) == rows_hash("data.sft", twin)
    identity = source_identity("data.sft", params.data.sft)["dataset"]
    assert identity["revision"] == (repo / "refs" / "main").read_text()
    assert identity["resolved"] == str(repo / "snapshots" / identity["revision"])


def _fails_fast(tmp_path, data: dict) -> str:
    start = time.perf_counter()
    with pytest.raises(ParamsError) as e:
        load_params(write_params(tmp_path, {"data": {"source": None, **data}, **SCORE}))
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "artifacts").exists()
    return str(e.value)


def test_an_id_not_in_the_cache_fails_fast_naming_the_key_the_id_and_the_download_command(tmp_path):
    message = _fails_fast(tmp_path, {"sft": {"path": "org/absent"}})
    assert "data.sft = 'org/absent': dataset id not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert "`hf download --repo-type dataset org/absent`" in message


def test_a_hub_that_never_answers_costs_at_most_the_reach_timeout(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as silent:  # accepts connections (the backlog) and never answers them
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        message = _fails_fast(tmp_path, {"sft": {"path": "org/absent", "revision": "v2"}})
    assert "data.sft = 'org/absent': dataset id not in the local Hugging Face cache" in message
    assert "the hub did not answer" in message
    assert "`hf download --repo-type dataset org/absent --revision v2`" in message


def test_bad_inputs_are_found_at_params_validation(tmp_path, folder):
    message = _fails_fast(tmp_path, {"sft": {"path": str(folder), "columns": {"quesion": "prompt"}}})
    assert (f"data.sft.columns names column 'quesion', which {folder} [train] does not have; its columns: "
            "question, answer") in message
    message = _fails_fast(tmp_path, {"sft": mapping(folder, split="validation")})
    assert f"data.sft.split = 'validation': {folder} has no such split; its splits: train, test" in message
    message = _fails_fast(tmp_path, {"sft": mapping(folder), "eval_source": mapping(folder, split="test[:0%]")})
    assert "data.eval_source.split = 'test[:0%]': no rows are left after the slice; widen it" in message
    message = _fails_fast(tmp_path, {"sft": {"path": str(folder), "colums": COLUMNS, "split": 3}})
    assert "data.sft.colums: unknown key; a data mapping takes path, name, split, columns, data_files, revision" \
        in message and "data.sft.split = 3: expected a string" in message
    message = _fails_fast(tmp_path, {"sft": mapping(folder, name="other")})
    assert "data.sft.name = 'other': BuilderConfig 'other' not found. Available: ['default']" in message
    message = _fails_fast(tmp_path, {"sft": mapping(tmp_path / "none" / "*.parquet")})
    assert "data.sft = " in message and "the pattern matches no file" in message


def test_a_string_that_looks_like_an_id_points_at_the_mapping_form(tmp_path):
    message = _fails_fast(tmp_path, {"sft": "org/name"})
    assert "data.sft = 'org/name': no such file or folder" in message and "given as {path: org/name}" in message


def test_spec_is_hashable_for_the_memo():
    assert hash(spec_of("data.sft", {"path": "a", "columns": {"x": "y"}, "data_files": ["a", "b"]})) == hash(
        DataSpec("data.sft", "a", columns=(("x", "y"),), data_files=("a", "b")))


def test_streaming_preprocess_reads_a_folder_like_its_jsonl_twin(tmp_path, folder):
    jsonl = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    outputs = []
    for name, sft in (("a", str(jsonl)), ("b", mapping(folder))):
        (tmp_path / name).mkdir()
        params = load_params(write_params(tmp_path / name, {"data": {"source": None, "sft": sft},
                                                            "preprocess": {"streaming": True}, **SCORE}))
        files = runner.run_stage("preprocess", params)["outputs"]["files"]
        outputs.append({k: v for k, v in files.items() if k != "report.json"})
    assert outputs[0] == outputs[1] and "sft_train.jsonl" in outputs[0]


def test_a_folder_without_data_files_is_refused_naming_the_key_and_the_folder(tmp_path):
    """load_dataset reads a folder holding only readme.txt as one text row: refused at params validation instead, by
    its dotted key and its folder, with why and the fix."""
    readme_only = tmp_path / "mine"
    for folder in (readme_only, tmp_path / "a", tmp_path / "b", tmp_path / "empty"):
        folder.mkdir()
    (readme_only / "readme.txt").write_text("Rows of my task, to come.\n")
    message = _fails_fast(tmp_path / "a", {"source": str(readme_only)})
    assert (f"data.source = '{readme_only}': the folder {readme_only} holds no data file, only readme.txt "
            "(load_dataset would read readme.txt as rows of text). Put the rows in it as .jsonl, .json, .csv, "
            ".parquet or .arrow files (or .txt, one text row per line), or set data.source to a data file") in message
    assert "data.eval_source" not in message and "score." not in message  # nothing that follows from reading it

    message = _fails_fast(tmp_path / "b", {"sft": mapping(tmp_path / "empty")})
    assert f"data.sft = '{tmp_path / 'empty'}': the folder {tmp_path / 'empty'} holds no file. Put the rows" in message


def test_data_files_are_what_load_dataset_reads_less_readmes_and_hidden_files(tmp_path):
    from stages.data.hub import data_files_in

    for name in ("README.md", "readme.txt", "LICENSE.txt", "notes.md", "config.json", ".hidden.jsonl",
                 ".git/x.json", "__pycache__/y.json", "data/train-00000-of-00001.parquet", "extra.jsonl.gz", "b.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in data_files_in(tmp_path)] == [
        "b.txt", "data/train-00000-of-00001.parquet", "extra.jsonl.gz"]


def test_a_data_key_logs_its_rows_builder_and_files(tmp_path, folder, caplog):
    import logging

    logger = logging.getLogger("stages.data.hub")
    logger.addHandler(caplog.handler)  # whatever propagation an earlier test's log setup left
    try:
        with caplog.at_level(logging.INFO, logger="stages.data.hub"):
            load_source(spec_of("data.sft", mapping(folder)))
            load_source(spec_of("data.eval_source", mapping(folder / "data" / "test-*.parquet")))
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "stages.data.hub"]
    assert (f"data.sft: 30 rows of {folder} [train], read by the parquet builder from 3 files: "
            "data/test-00000-of-00001.parquet, data/train-00000-of-00002.parquet, data/train-00001-of-00002.parquet"
            in lines)
    assert any(line.startswith("data.eval_source: 8 rows of ") and line.endswith(
        f"read by the parquet builder from 1 file: {folder}/data/test-00000-of-00001.parquet") for line in lines), lines
