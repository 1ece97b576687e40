"""benchmarks/tokenize.py --tiny: every variant runs in its own process and gives the same tokens."""
from __future__ import annotations

import pytest

from benchmarks import tokenize

pytestmark = pytest.mark.slow


def test_every_variant_gives_the_same_tokens(capsys):
    results = tokenize.run(["--tiny", "--rows", "0", "--num-proc", "1"])
    assert [r["variant"] for r in results] == ["before", "after np=1", "after np=1 warm", "after arrow np=1"]
    assert {r["rows"] for r in results} == {2000} and len({r["checksum"] for r in results}) == 1
    assert [r["from_cache"] for r in results] == [False, False, True, False]  # warm: read back, not tokenised
    assert "SFT tokenisation of 2,000 chat rows" in capsys.readouterr().out
