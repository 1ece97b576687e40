import json

import pytest

from stages.harness import artifacts


def _seal(folder, fp="abc"):
    return artifacts.write_manifest(folder, {"stage": "x", "fingerprint": fp})


def test_atomic_output_success_replaces_previous(tmp_path):
    final = tmp_path / "out"
    for content in ("one", "two"):
        with artifacts.atomic_output(final) as tmp:
            (tmp / "data.txt").write_text(content)
            _seal(tmp)
    assert (final / "data.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old folders left behind


def test_crash_leaves_previous_version_and_no_partial_folder(tmp_path):
    final = tmp_path / "out"
    with artifacts.atomic_output(final) as tmp:
        (tmp / "data.txt").write_text("good")
        _seal(tmp)
    with pytest.raises(RuntimeError, match="boom"):
        with artifacts.atomic_output(final) as tmp:
            (tmp / "data.txt").write_text("half")
            raise RuntimeError("boom")
    assert (final / "data.txt").read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_unsealed_output_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="no manifest"):
        with artifacts.atomic_output(tmp_path / "out") as tmp:
            (tmp / "data.txt").write_text("x")
    assert not (tmp_path / "out").exists()


def test_manifest_written_last_and_lists_every_file(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"\x00\x01")
    m = _seal(tmp_path)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk.pop("manifest_hash") == artifacts.hash_json(m)  # sealed by its own hash
    assert on_disk == m
    assert set(m["outputs"]["files"]) == {"a.txt", "sub/b.bin"}
    assert m["outputs"]["hash"] == artifacts.tree_hash(m["outputs"]["files"])


@pytest.mark.parametrize("damage", ["delete", "edit", "truncate", "add", "manifest"])
def test_verify_detects_damage(tmp_path, damage):
    (tmp_path / "model.bin").write_bytes(b"x" * 1000)
    (tmp_path / "rows.jsonl").write_text('{"a": 1}\n')
    _seal(tmp_path, fp="fp1")
    assert artifacts.verify(tmp_path, "fp1") == (True, "")
    if damage == "delete":
        (tmp_path / "rows.jsonl").unlink()
    elif damage == "edit":
        (tmp_path / "rows.jsonl").write_text('{"a": 2}\n')
    elif damage == "truncate":
        (tmp_path / "model.bin").write_bytes(b"x" * 500)
    elif damage == "add":
        (tmp_path / "stray.txt").write_text("?")
    else:
        (tmp_path / "manifest.json").write_text("{not json")
    ok, why = artifacts.verify(tmp_path, "fp1")
    assert not ok and why


def test_verify_detects_stale_fingerprint(tmp_path):
    _seal(tmp_path, fp="old")
    ok, why = artifacts.verify(tmp_path, "new")
    assert not ok and why.startswith("stale")


def test_fingerprint_depends_on_params_code_and_upstream():
    base = artifacts.fingerprint("sft", {"sft": {"lr": 1}}, "code1", {"preprocess": "h1"})
    assert base == artifacts.fingerprint("sft", {"sft": {"lr": 1}}, "code1", {"preprocess": "h1"})
    assert base != artifacts.fingerprint("sft", {"sft": {"lr": 2}}, "code1", {"preprocess": "h1"})
    assert base != artifacts.fingerprint("sft", {"sft": {"lr": 1}}, "code2", {"preprocess": "h1"})
    assert base != artifacts.fingerprint("sft", {"sft": {"lr": 1}}, "code1", {"preprocess": "h2"})


def test_logs_are_verified_but_not_in_the_outputs_hash(tmp_path):
    def build(folder, run):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "weights.bin").write_bytes(b"w" * 100)
        (folder / "log_history.json").write_text(f'[{{"train_runtime": {run}}}]')
        (folder / "tensorboard").mkdir()
        (folder / "tensorboard" / f"events.out.tfevents.{run}.host").write_bytes(b"e")
        return _seal(folder)

    a, b = build(tmp_path / "a", 1.5), build(tmp_path / "b", 2.5)
    assert set(a["outputs"]["files"]) == {"model/weights.bin"}
    assert set(a["logs"]["files"]) == {"log_history.json", "tensorboard/events.out.tfevents.1.5.host"}
    assert a["outputs"]["hash"] == b["outputs"]["hash"] and a["logs"]["hash"] != b["logs"]["hash"]
    assert artifacts.verify(tmp_path / "a") == (True, "")
    (tmp_path / "a" / "log_history.json").write_text("[]")  # a log is still checked: an edited one is damage
    ok, why = artifacts.verify(tmp_path / "a")
    assert not ok and "log_history.json" in why
