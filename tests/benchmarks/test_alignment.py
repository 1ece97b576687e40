"""benchmarks/alignment.py: the tuning budget, the choice, and a sweep that looks at eval only for the choice."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from stages import artifacts
from stages.config import load_params
from tests.benchmarks.helpers import as_sets, load_benchmark
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def alignment():
    return load_benchmark("alignment")


def test_every_method_gets_the_same_budget_of_valid_configurations(alignment):
    assert set(alignment.SWEEP) == set(alignment.METHODS)
    for method in alignment.METHODS:
        configs = alignment.configurations(method)
        assert len(configs) == 4 and len({alignment.config_name(c) for c in configs}) == 4, method
        for c in configs:  # each is a valid params override of its method's section
            params = load_params(ROOT / "params.yaml", {"policy.method": method,
                                                        **{f"policy.{method}.{k}": v for k, v in c.items()}})
            assert all(getattr(getattr(params.policy, method), k) == v for k, v in c.items())


def test_pick_takes_the_best_mean_dev_accuracy_and_the_first_on_a_tie(alignment):
    assert alignment.pick({"a": 0.5, "b": 0.7, "c": 0.7}) == "b"
    assert alignment.mean_sd([0.5, 0.7]) == pytest.approx((0.6, 0.02 ** 0.5))  # sample sd: sqrt((0.1² + 0.1²) / 1)
    assert alignment.mean_sd([0.5]) == (0.5, 0.0)


@pytest.mark.slow
def test_sweep_scores_every_configuration_on_dev_and_only_the_choice_on_eval(alignment, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setattr(alignment, "SWEEP", {"dpo": {"learning_rate": [1e-4, 3e-4], "beta": [0.1]}})
    monkeypatch.setattr(alignment, "RESULTS", tmp_path / "RESULTS-alignment.md")
    out = tmp_path / "bench"
    alignment.main(["--sweep", "--seeds", "1", "2", "--methods", "dpo", "--output-dir", str(out), "--write",
                    *as_sets(SMALL)])
    printed = capsys.readouterr().out
    chosen = re.search(r"^dpo: dev accuracy per configuration .*; chosen (\S+)$", printed, re.M).group(1)
    names = [alignment.config_name(c) for c in alignment.configurations("dpo")]
    assert chosen in names
    for seed in (1, 2):
        shared = artifacts.read_manifest(out / f"seed-{seed}" / "shared" / "sft")
        for name in names:
            folder = out / f"seed-{seed}" / f"dpo-{name}"
            assert (folder / "sft").is_symlink() and artifacts.read_manifest(folder / "sft") == shared
            split = artifacts.read_manifest(folder / "evaluate")["metrics"]["split"]
            assert split == ("eval" if name == chosen else "dev"), (seed, name)  # eval never seen by the others
    assert (artifacts.read_manifest(out / "seed-1" / "shared" / "sft")["fingerprint"]
            != artifacts.read_manifest(out / "seed-2" / "shared" / "sft")["fingerprint"])  # run.seed reaches sft
    report = (tmp_path / "RESULTS-alignment.md").read_text()
    assert "## Sweep (dev only)" in report and all(f"| dpo | {n}" in report.replace("**", "") for n in names)
    assert re.search(r"\| dpo \| " + re.escape(chosen) + r" \| \d+\.\d% ± \d+\.\d% \|", report)
