"""README, literally: its Quickstart's `make run` on a fresh clone, then every command of its DVC section.

A fresh `git clone` of this repository's HEAD (commit first: uncommitted changes are not in the
clone), `make run` there (a venv install and the whole pipeline on the default params: minutes,
so marked `readme` and left out of `make test`; `.ci/run` runs it after), then the first bash
block under "## DVC", line by line in bash with its activation line: `dvc status` clean, `dvc repro`
a no-op within 3 s, `dvc metrics show` one short row per model, `dvc plots show` a page with no
script from elsewhere.

    .venv/bin/python -m pytest -q -m readme -s
"""
import os
import re
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.test_dvc import without_venv

pytestmark = pytest.mark.readme


def commands(section: str) -> list[str]:
    """The command lines of the first ```bash block under `## <section>`, comments dropped."""
    text = (ROOT / "README.md").read_text()
    part = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = part.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def bash(script: str, cwd, env, timeout=600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    res = subprocess.run(["bash", "-c", f"set -euo pipefail\n{script}"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return res, time.perf_counter() - t0


def test_quickstart_then_dvc_section_on_a_fresh_clone(tmp_path):
    clone = tmp_path / "align"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = without_venv()  # a shell where nothing is activated
    assert "make run" in commands("Quickstart")
    try:
        res, took = bash("make run", clone, env, timeout=3600)
        print(f"make run on a fresh clone: {took:.0f}s")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert (clone / "dvc.lock").is_file(), "make run left no dvc.lock\n" + res.stdout[-3000:] + res.stderr[-3000:]

        dvc = commands("DVC")
        activate = [c for c in dvc if c.startswith((". ", "source "))]
        assert activate == [". .venv/bin/activate"], dvc
        seen = set()
        for cmd in dvc:
            if cmd in activate:
                continue
            res, took = bash(f"{activate[0]}\n{cmd}", clone, env)
            out = res.stdout + res.stderr
            print(f"{cmd}: {took:.2f}s")
            assert res.returncode == 0, f"{cmd}:\n{out}"
            seen.add(cmd)
            if cmd == "dvc status":
                assert "Data and pipelines are up to date." in out, out
            elif cmd == "dvc repro":
                assert "Running stage" not in out, out
            elif cmd == "dvc metrics show":
                lines = res.stdout.strip().splitlines()
                assert lines[0].split() == ["Path", "accuracy", "reward", "win_rate"], out
                assert len(lines) == 5 and max(map(len, lines)) <= 80, out
            elif cmd == "dvc plots show":
                page = (clone / "dvc_plots" / "index.html").read_text()
                assert "vegaEmbed(" in page and not re.search(r"<script[^>]+src=", page)
        assert seen == {"dvc status", "dvc repro", "dvc metrics show", "dvc plots show"}, seen
    finally:
        if (clone / ".venv" / "bin" / "align").exists():
            subprocess.run([str(clone / ".venv" / "bin" / "align"), "server", "stop"], cwd=clone, env=env,
                           capture_output=True, timeout=60)
