"""stages.dvcgen: each DVC stage depends on its stage's code closure, file by file, and its upstream outputs."""
from stages.dvcgen import dvc_stages
from stages.registry import STAGES


def test_deps_are_the_code_closure_and_the_upstream_outputs():
    stages = dvc_stages("out")["stages"]
    assert list(stages) == list(STAGES)
    for name, spec in STAGES.items():
        deps = stages[name]["deps"]
        assert deps == [*spec.code(), *(f"out/{u}" for u in spec.upstream)]
        assert all(d.endswith(".py") for d in deps[:len(spec.code())])  # files, never folders
        assert stages[name]["params"] == list(spec.params)
