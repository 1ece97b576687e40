"""stages.harness.dvcgen: each DVC stage depends on its stage's code closure, file by file, and its upstream outputs."""
from pathlib import Path

from stages.harness.dvcgen import dvc_stages, render_dvc_yaml
from stages.harness.registry import STAGES
from tests.conftest import ROOT


def test_committed_dvc_yaml_is_generated_from_registry():
    """A new module in a stage's code closure changes dvc.yaml: the committed file must follow (fast, so that
    `make test` catches it)."""
    assert (ROOT / "dvc.yaml").read_text() == render_dvc_yaml(), "run: python -m stages dvc-yaml > dvc.yaml"


def test_deps_are_the_code_closure_and_the_upstream_outputs():
    stages = dvc_stages("out")["stages"]
    assert list(stages) == list(STAGES)
    for name, spec in STAGES.items():
        deps = stages[name]["deps"]
        assert deps == [*spec.code(), *(f"out/{u}" for u in spec.upstream)]
        assert all(Path(ROOT, d).is_file() for d in deps[:len(spec.code())])  # files, never folders
        assert stages[name]["params"] == list(spec.params)


def test_the_users_input_files_named_in_params_are_deps(tmp_path):
    """Own data and a local model folder: DVC reruns the stages that read them when their content changes."""
    from stages.harness.params_loader import load_params
    from tests.conftest import write_params

    data, model = tmp_path / "train.jsonl", tmp_path / "hub-id-like"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    params = load_params(write_params(tmp_path, {
        "data": {"source": None, "sft": str(data)},
        "score": {"reward_functions": ["exact_match"], "reward_weights": None}}))
    stages = dvc_stages("out", params)["stages"]
    assert stages["preprocess"]["deps"][-1] == str(data)
    assert str(model) not in stages["sft"]["deps"]  # builtin:tiny names no file
    assert all(str(data) not in stages[s]["deps"] for s in STAGES if s != "preprocess")
