"""lm-evaluation-harness tasks through `stages.evaluation.lm_eval`: the same figures as lm-eval's own CLI."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.builtin import arithmetic, tiny
from stages.evaluation import lm_eval as ours

pytest.importorskip("lm_eval")

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k_sample.jsonl"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny model folder, the built-in task's eval split, and a multiple-choice task YAML of our own (a random
    model scores away from 0 there, so the comparison is between figures that could differ)."""
    root = tmp_path_factory.mktemp("lm-eval")
    model = tiny.build(root / "model", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                       vocab_size=384, seed=0)
    rows = arithmetic.generate(num_train=1, num_preference=1, num_eval=16, digits=2, error_rate=0.7,
                               reasoning=True, seed=0)["eval"]
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rng = random.Random(0)
    choice_rows = []
    for _ in range(40):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        choices = [str(a + b), str(a + b + 1), str(a + b - 10), str(a * b)]
        rng.shuffle(choices)
        choice_rows.append({"question": f"{a}+{b}=", "choices": choices, "label": choices.index(str(a + b))})
    choice_data = root / "choice.jsonl"
    choice_data.write_text("".join(json.dumps(r) + "\n" for r in choice_rows))
    choice_task = root / "sums_choice.yaml"
    choice_task.write_text(yaml.safe_dump({
        "task": "sums_choice", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(choice_data)}},
        "output_type": "multiple_choice", "test_split": "test", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}))
    return {"root": root, "model": str(model), "eval": eval_file, "choice": choice_task}


@pytest.mark.slow
def test_our_figures_equal_the_cli(folders, monkeypatch):
    """The two shipped tasks and a user's YAML task: `evaluate_model` and `lm_eval run --model hf` on the same
    folder give the same numbers, key for key."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    specs = ours.task_specs(["align_arithmetic", "align_gsm8k", str(folders["choice"])], folder=folders["root"] /
                            "tasks", eval_file=folders["eval"], gsm8k_data=str(DATA))
    got = ours.evaluate_model(folders["model"], specs, batch_size=4, apply_chat_template=True)

    out = folders["root"] / "cli"
    cli = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
           f"pretrained={folders['model']},dtype=float32", "--tasks", ",".join(s.argument for s in specs),
           "--batch_size", "4", "--apply_chat_template", "--output_path", str(out)]
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [result_file] = list(out.rglob("results_*.json"))
    expected = ours.columns(json.loads(result_file.read_text())["results"])

    assert got == expected
    assert set(got) >= {"lm_eval.align_arithmetic.exact_match",
                        "lm_eval.align_gsm8k.exact_match.strict-match",
                        "lm_eval.align_gsm8k.exact_match.flexible-extract",
                        "lm_eval.sums_choice.acc", "lm_eval.sums_choice.acc_norm",
                        "lm_eval.sums_choice.acc_stderr"}
    assert 0 < got["lm_eval.sums_choice.acc"] < 1  # a figure that could have differed
    # and the table the CLI prints shows them
    row = re.search(r"\|acc\s+\|\S+\s+\|\s*([0-9.]+)\|±\s+\|([0-9.]+)\|", done.stdout)
    assert row, done.stdout[-2000:]
    assert float(row[1]) == pytest.approx(got["lm_eval.sums_choice.acc"], abs=1e-4)
    assert float(row[2]) == pytest.approx(got["lm_eval.sums_choice.acc_stderr"], abs=1e-4)


def test_columns_name_task_metric_and_filter():
    results = {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
                         "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": "N/A"},
               "arc_easy": {"acc,none": 0.75, "acc_stderr,none": 0.05, "alias": "arc_easy", "samples": 4}}
    assert ours.columns(results) == {
        "lm_eval.gsm8k.exact_match.strict-match": 0.25, "lm_eval.gsm8k.exact_match_stderr.strict-match": 0.1,
        "lm_eval.gsm8k.exact_match.flexible-extract": 0.5, "lm_eval.arc_easy.acc": 0.75,
        "lm_eval.arc_easy.acc_stderr": 0.05}
    assert ours.stderr_column("lm_eval.gsm8k.exact_match.strict-match") == \
        "lm_eval.gsm8k.exact_match_stderr.strict-match"
    assert ours.stderr_column("lm_eval.arc_easy.acc") == "lm_eval.arc_easy.acc_stderr"


def test_a_registry_task_without_its_dataset_offline_names_task_and_dataset(monkeypatch, tmp_path):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    specs = ours.task_specs(["gsm8k"], folder=tmp_path, eval_file=None, gsm8k_data=None)
    with pytest.raises(ours.LmEvalError, match=r"'gsm8k', whose dataset openai/gsm8k \(main\) is not in the local"):
        ours.check_datasets(specs)
    with pytest.raises(ours.LmEvalError, match=r"not in lm-eval's registry"):
        ours.check_datasets(ours.task_specs(["no_such_task_xyz"], folder=tmp_path, eval_file=None, gsm8k_data=None))


def test_shipped_tasks_need_their_data(tmp_path):
    with pytest.raises(ours.LmEvalError, match="align_gsm8k, which needs evaluate.lm_eval.gsm8k_data"):
        ours.task_specs(["align_gsm8k"], folder=tmp_path, eval_file=tmp_path / "e.jsonl", gsm8k_data=None)
    with pytest.raises(ours.LmEvalError, match="no such task YAML file"):
        ours.task_specs([str(tmp_path / "missing.yaml")], folder=tmp_path, eval_file=None, gsm8k_data=None)
    [spec] = ours.task_specs(["align_gsm8k"], folder=tmp_path, eval_file=None, gsm8k_data=str(DATA))
    written = yaml.safe_load(Path(spec.argument).read_text())
    assert written["dataset_kwargs"]["data_files"]["test"] == str(DATA.resolve())
    assert ours.task_name(spec) == "align_gsm8k"
