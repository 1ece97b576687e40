"""`python -m benchmarks peers`: every trainer with a TRL peer runs on both sides and the table reports a speed ratio
for each; PPO (TRL 1.16 has none) runs on ours alone; each side's share of the matmul peak is printed."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.filterwarnings("ignore")
def test_peers_prints_a_ratio_per_trainer(capsys):
    pytest.importorskip("trl")
    from benchmarks import peers

    assert peers.main(["--tiny", "--steps", "3", "--warmup", "1", "--rounds", "1", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in re.finditer(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", out, re.M)}
    assert set(rows) == set(peers.TRAINERS) - {"ppo"}, out
    ppo = re.search(r"^\| ppo \| ([\d.]+) \| n/a \| n/a \|.* \| (\d+)% \| n/a \|$", out, re.M)
    assert ppo and float(ppo.group(1)) > 0, out
    assert re.search(r"matmul peak \(2048 x 2048, best of 5\): fp32 1 thread\(s\) [\d.]+ GFLOP/s", out), out
    for name, m in rows.items():
        ours, trl, ratio = float(m.group(2)), float(m.group(3)), float(m.group(4))
        assert ours > 0 and trl > 0, name
        # TRL's s/step over ours, from the unrounded times: within what the printed 4 decimals of each time
        # and 2 of the ratio allow
        half = 0.00005
        assert (trl - half) / (ours + half) - 0.005 <= ratio <= (trl + half) / (ours - half) + 0.005, name
    assert re.search(r"1-min load [\d.]+ before, [\d.]+ after", out), out


def test_the_library_never_imports_trl():
    """TRL is the benchmark's peer (the `bench` extra), never a dependency of `stages/`."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "stages").rglob("*.py")
                 if re.search(r"^\s*(import trl\b|from trl\b)", p.read_text(), re.M)]
    assert offenders == []
