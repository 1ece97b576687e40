"""benchmarks/faults.py --tiny, the CI subset of the fault-injection campaign: a SIGKILL inside sft's checkpoint
save, a flipped bit in sft's weights and (where a tmpfs can be mounted) a full disk in sft's save, each injected
into a real `align run` of the small pipeline. Every run must recover to the reference's bytes, leaving nothing."""
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
