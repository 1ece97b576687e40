"""`python -m benchmarks alignment`: the tuning budget, the choice, and a sweep that looks at eval only for the
choice."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from stages.harness import artifacts
from stages.harness.params_loader import load_params
from tests.benchmarks.helpers import as_sets
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def alignment():
    from benchmarks import alignment

    return alignment


def test_every_method_gets_the_same_budget_of_valid_configurations(alignment):
    params_yaml = load_params(ROOT / "params.yaml")
    for round_, size in ((1, 4), (2, 2), (3, 3)):
        assert set(alignment.ROUNDS[round_ - 1]) == set(alignment.METHODS)
        for method in alignment.METHODS:
            configs = alignment.configurations(method, round_)
            assert len(configs) == size and len({alignment.config_name(c) for c in configs}) == size, method
            for c in configs:  # each is a valid params override of its method's section, presets expanded
                sets = alignment.overrides(method, c)
                params = load_params(ROOT / "params.yaml", {"policy.method": method, **sets})
                assert all(alignment.effective(params, k) == v for k, v in sets.items()), (method, c)
            # each round's choice is what params.yaml holds, for the knobs no later round tunes again: exactly one
            later = {k for r in alignment.ROUNDS[round_:] for k in r[method]}
            kept = [dict(t) for t in dict.fromkeys(tuple((k, v) for k, v in c.items() if k not in later)
                                                   for c in configs)]
            if all(kept):
                assert sum(alignment.holds(params_yaml, method, c) for c in kept) == 1, (method, round_)


def test_pick_takes_the_best_mean_dev_accuracy_and_the_first_on_a_tie(alignment):
    assert alignment.pick({"a": 0.5, "b": 0.7, "c": 0.7}) == "b"
    assert alignment.mean_sd([0.5, 0.7]) == pytest.approx((0.6, 0.02 ** 0.5))  # sample sd: sqrt((0.1² + 0.1²) / 1)
    assert alignment.mean_sd([0.5]) == (0.5, 0.0)


@pytest.mark.slow
def test_sweep_scores_every_configuration_on_dev_and_only_the_choice_on_eval(alignment, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setattr(alignment, "ROUNDS", [{"dpo": {"learning_rate": [1e-4, 3e-4], "beta": [0.1]}}])
    out = tmp_path / "bench"
    assert alignment.main(["--sweep", "1", "--seeds", "1", "2", "--methods", "dpo", "--output-dir", str(out),
                           "--write", str(tmp_path / "sweep-1.md"), *as_sets(SMALL)]) == 0
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
    report = (tmp_path / "sweep-1.md").read_text()
    assert "## Sweep (dev only)" in report and all(f"| dpo | {n}" in report.replace("**", "") for n in names)
    assert re.search(r"\| dpo \| " + re.escape(chosen) + r" \| \d+\.\d% ± \d+\.\d% \|", report)


def test_a_configuration_that_sets_score_runs_its_own_score_stage(alignment):
    assert alignment.own_stages({"beta": 0.3}) == ()
    assert alignment.own_stages({"score.generation.temperature": 1.3}) == ("score",)
    assert alignment.overrides("dpo", {"score.generation.temperature": 1.3, "beta": 0.3}) == {
        "score.generation.temperature": 1.3, "policy.dpo.beta": 0.3}
    assert alignment.overrides("ppo", {"rewards": "exact_match+reward_model"}) == {
        "policy.ppo.reward_functions": ["exact_match", "reward_model_prob"], "policy.ppo.reward_weights": [1.0, 0.5]}
