"""Bad-input suite: every case must fail with a non-zero exit, a message that names the file and
line / column / key, and no output or manifest written (what was there before stays untouched)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from stages.__main__ import main
from tests.conftest import write_params


def manifests(out: Path) -> dict[str, bytes]:
    """Every manifest under `out` with its bytes."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("manifest.json")} if out.exists() else {}


def assert_rejected(capsys, params: Path, stage: str, *patterns: str, sets: tuple[str, ...] = (),
                    code: int | None = None) -> str:
    """Run `python -m stages <stage>` in-process; assert it failed, the message matches every pattern
    (regexes), and nothing was written: no stage folder, no new or changed manifest, no partial folder."""
    out = params.parent / "artifacts"
    before = manifests(out)
    stage_existed = (out / stage).exists()
    capsys.readouterr()
    rc = main([stage, "--params", str(params), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert rc != 0, f"exit 0 for a bad input; stderr:\n{err}"
    if code is not None:
        assert rc == code, err
    for pattern in patterns:
        assert re.search(pattern, err), f"{pattern!r} not in:\n{err}"
    assert manifests(out) == before, "a manifest was written or changed"
    assert (out / stage).exists() == stage_existed
    leftovers = [p.name for p in out.rglob(".tmp-*")] if out.exists() else []
    assert not leftovers, leftovers
    assert not list(out.glob(f".work/{stage}-*")), "a work folder was left behind"
    if out.exists():
        assert not list((out / "metrics").glob(f"{stage}.json")) or stage_existed
    return err


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny local model folder outside every case's output folder (no builtin build per case)."""
    from stages.builtin import tiny

    return tiny.build(tmp_path_factory.mktemp("bad-inputs-model"), hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, vocab_size=384, seed=0)


@pytest.fixture
def params_for(tmp_path, model_dir):
    """params_for(extra) -> a small params.yaml in tmp_path using the tiny local model.

    Rule rewards only: the cases' files hold no preference rows, so no reward model is trained
    (with reward_model among score's rewards, params validation stops before the data is read)."""
    def make(extra: dict | None = None) -> Path:
        base = {"model": {"name_or_path": str(model_dir)}, "score": {"reward_functions": ["exact_match"]}}
        from tests.conftest import deep_update

        return write_params(tmp_path, deep_update(base, extra or {}))
    return make


def escape(path: Path | str) -> str:
    return re.escape(str(path))
