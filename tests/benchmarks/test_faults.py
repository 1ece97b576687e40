"""benchmarks/faults.py --tiny, the CI subset of the fault-injection campaign: a SIGKILL inside sft's checkpoint
save, a flipped bit in sft's weights and (where a tmpfs can be mounted) a full disk in sft's save, each injected
into a real `align run` of the small pipeline. Every run must recover to the reference's bytes, leaving nothing.
Beside it, the first race of the concurrent fault: a manual `align run` and the nightly deployment at once."""
from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def can_mount_tmpfs(tmp_path) -> bool:
    folder = tmp_path / "probe"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(folder)], capture_output=True)
    return True


def test_tiny_campaign_recovers_every_fault_to_the_same_bytes(tmp_path, capsys):
    from benchmarks.faults import main

    rc = main(["--tiny", "--seed", "0", "--json", str(tmp_path / "faults.json")])
    out = capsys.readouterr().out
    table = {row["fault"]: row for row in json.loads((tmp_path / "faults.json").read_text())["table"]}
    expected = {"sigkill", "flipped-byte"} | ({"disk-full"} if can_mount_tmpfs(tmp_path) else set())
    assert set(table) == expected, out[-3000:]
    for fault, row in table.items():
        assert row["runs"] >= 1, (fault, row)
        assert row["recovered"] == row["runs"] and row["identical"] == row["runs"], (fault, row, out[-3000:])
        assert row["leftovers"] == 0, (fault, row, out[-3000:])
        assert row["median_recovery_s"] > 0
    assert rc == 0
    assert "median recovery s" in out and "sigkill" in out


def test_a_manual_run_and_the_nightly_deployment_at_once_build_each_output_once(tmp_path, capsys):
    """The concurrent fault's first race (about a minute): `align run` beside a run of align/nightly triggered
    through `align serve`, same params. Exactly one of them builds each missing stage, the nightly promotes the
    reference's merged model, `align serve` stops on SIGTERM leaving nothing."""
    from benchmarks.faults import main

    rc = main(["--tiny", "--only", "concurrent", "--seed", "0", "--json", str(tmp_path / "faults.json")])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "faults.json").read_text())
    (row,), (run,) = report["table"], report["runs"]
    assert row["fault"] == "concurrent" and run["point"] == "1 run + nightly, same params", out[-3000:]
    assert run["recovered"] and run["identical"] and not run["leftovers"], out[-3000:]
    assert any(note.startswith("nightly built") for note in run["notes"]), run["notes"]
    assert rc == 0
