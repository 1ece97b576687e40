"""The judge's prompt and the lm-eval task YAMLs are part of the evaluate stage's fingerprint and DVC deps: the
shipped ones as its code (their modules' CODE_FILES), the user's (evaluate.judge.prompt_file, a YAML path in
evaluate.lm_eval.tasks) as its input files. Editing any of them makes evaluate, and only evaluate, stale."""
from __future__ import annotations

import shutil

from stages.harness import runner
from stages.harness.dvcgen import dvc_stages
from stages.harness.params_loader import load_params
from stages.harness.registry import STAGES
from tests.conftest import ROOT, write_params

SHIPPED = ("stages/evaluation/prompts/pairwise.txt", "stages/evaluation/tasks/align_arithmetic.yaml",
           "stages/evaluation/tasks/align_gsm8k.yaml")


def test_editing_a_shipped_prompt_or_task_makes_evaluate_stale(tmp_path):
    """On a copy of the code tree: one byte more in each shipped file changes the fingerprint of evaluate and of
    no other stage; the committed dvc.yaml lists them as evaluate's deps."""
    params = load_params(write_params(tmp_path))
    root = tmp_path / "code"
    shutil.copytree(ROOT / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    inputs = {name: {up: f"outputs-of-{up}" for up in spec.upstream} for name, spec in STAGES.items()}

    def fingerprints():
        return {name: runner._fingerprint(name, params, inputs[name], root=root) for name in STAGES}

    before = fingerprints()
    for rel in SHIPPED:
        path = root / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        try:
            after = fingerprints()
        finally:
            path.write_bytes(original)
        assert {name for name in STAGES if after[name] != before[name]} == {"evaluate"}, rel
    assert fingerprints() == before
    assert set(SHIPPED) <= set(dvc_stages()["stages"]["evaluate"]["deps"])
    assert set(SHIPPED) <= set(runner.get_stage("promote").code())  # promote asks the same judge


def test_editing_the_users_prompt_or_task_yaml_makes_evaluate_stale(tmp_path):
    prompt = tmp_path / "my_prompt.txt"
    prompt.write_text("{instruction}\nA: {output_1}\nB: {output_2}\nReply 1, 2 or tie.\n")
    task = tmp_path / "my_task.yaml"
    task.write_text("task: my_task\ndataset_path: json\n")
    params = load_params(write_params(tmp_path, {"evaluate": {
        "lm_eval": {"tasks": ["align_arithmetic", str(task)]},
        "judge": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "prompt_file": str(prompt)}}}))
    spec = runner.get_stage("evaluate")
    upstream = {up: f"outputs-of-{up}" for up in spec.upstream}
    hashes = runner.input_hashes(spec, params)
    assert {"file:evaluate.lm_eval.tasks[1]", "file:evaluate.judge.prompt_file"} <= set(hashes)
    assert "file:evaluate.lm_eval.tasks[0]" not in hashes  # a registry or shipped name is no file
    before = runner._fingerprint("evaluate", params, upstream)
    for path, more in ((prompt, "Be brief.\n"), (task, "num_fewshot: 2\n")):
        original = path.read_text()
        path.write_text(original + more)  # same path, other content
        assert runner._fingerprint("evaluate", params, upstream) != before, path
        path.write_text(original)
        assert runner._fingerprint("evaluate", params, upstream) == before, path
    deps = dvc_stages(params=params)["stages"]["evaluate"]["deps"]  # `python -m stages dvc-yaml` with these params
    assert str(task) in deps and str(prompt) in deps and "align_arithmetic" not in deps
