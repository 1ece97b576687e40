"""stages.harness.registry: the stage table is consistent, and a stage's fingerprint follows exactly the code it
imports."""
import inspect
import shutil

from stages.harness import runner
from stages.harness.config import Params
from stages.harness.params_loader import load_params
from stages.harness.registry import STAGES, resolve
from tests.conftest import ROOT, write_params


def test_table_order_upstreams_and_references():
    assert list(STAGES) == ["preprocess", "sft", "reward", "score", "reference", "policy", "merge", "evaluate"]
    for i, spec in enumerate(STAGES.values()):
        earlier = list(STAGES)[:i]
        assert set(spec.upstream) <= set(earlier), f"{spec.name}: an upstream stage must come before it"
        assert list(inspect.signature(resolve(spec.entry)).parameters) == ["ctx"]
        if spec.shards:
            assert list(inspect.signature(resolve(spec.shards)).parameters) == ["ctx", "shard", "num_shards"]
        if spec.trains:
            assert list(inspect.signature(resolve(spec.training_rows)).parameters) == ["params", "manifests"]
        Params().select(spec.params)  # every declared key exists
    assert [s.name for s in STAGES.values() if s.trains] == ["sft", "reward", "policy"]
    assert [s.name for s in STAGES.values() if s.shards] == ["score", "evaluate"]


def test_closures_hold_what_the_hand_lists_missed():
    """The files that hand-written lists missed (their edits left stale outputs current): the shared helpers,
    and the model-forward blocks that score and evaluate reach through the reward model, not through a trainer."""
    assert {"stages/tensors.py", "stages/trainers/pair_batches.py"} <= set(STAGES["reference"].code())
    for stage in ("score", "evaluate"):
        code = set(STAGES[stage].code())
        assert {"stages/reward_model.py", "stages/logprobs.py", "stages/kernels.py", "stages/basics.py"} <= code
        assert not any(f.endswith("_trainer.py") for f in code), stage
    assert {"stages/metrics/bleu/bleu.py", "stages/metrics/rouge/rouge.py"} <= set(STAGES["evaluate"].code())
    for spec in STAGES.values():  # the harness is not a stage's code: editing it rebuilds nothing
        assert not ({"stages/harness/runner.py", "stages/harness/launch.py", "stages/harness/registry.py"}
                    & set(spec.code()))


def test_touching_a_module_marks_stale_exactly_the_stages_whose_closure_holds_it(tmp_path):
    """For every file under stages/: one byte more in it changes the fingerprint (runner._fingerprint, on a copy
    of the code tree) of exactly the stages whose import closure contains it, with their inputs unchanged."""
    params = load_params(write_params(tmp_path))
    root = tmp_path / "code"
    shutil.copytree(ROOT / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    inputs = {name: {up: f"outputs-of-{up}" for up in spec.upstream} for name, spec in STAGES.items()}

    def fingerprints(code_root):
        return {name: runner._fingerprint(name, params, inputs[name], root=code_root) for name in STAGES}

    before = fingerprints(root)
    assert before == fingerprints(runner.artifacts.CODE_ROOT)  # the copy fingerprints as the real tree does
    closures = {name: set(spec.code(root)) for name, spec in STAGES.items()}
    counts = set()
    for path in sorted((root / "stages").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        original = path.read_bytes()
        path.write_bytes(original + b"\n# touched\n")
        try:
            after = fingerprints(root)
        finally:
            path.write_bytes(original)
        stale = {name for name in STAGES if after[name] != before[name]}
        assert stale == {name for name, files in closures.items() if rel in files}, rel
        counts.add(len(stale))
    assert {0, 1, len(STAGES)} <= counts  # files of no stage, of one stage, of every stage
    assert fingerprints(root) == before



def test_tools_named_in_params_enter_the_fingerprints_of_policy_and_evaluate(tmp_path):
    """policy.grpo.tools is read by policy (the trainer's tools=) and evaluate (answers through them): changing it
    makes both stale and no other stage; a tool in a project module is their code (hashed, a dvc dep)."""
    from stages.harness.dvcgen import dvc_stages

    inputs = {name: {up: f"outputs-of-{up}" for up in spec.upstream} for name, spec in STAGES.items()}

    def params(folder, tools):
        (tmp_path / folder).mkdir()
        return load_params(write_params(tmp_path / folder, {"policy": {"grpo": {"tools": tools}}}))

    plain = params("a", [])
    tools = params("b", ["tests.stages.tools.user_tools.mul"])
    project = params("c", ["stages.builtin.arithmetic_errors.error_kind"])
    before = {n: runner._fingerprint(n, plain, inputs[n]) for n in STAGES}
    for changed in (tools, project):
        after = {n: runner._fingerprint(n, changed, inputs[n]) for n in STAGES}
        assert {n for n in STAGES if after[n] != before[n]} == {"policy", "evaluate"}
    assert "tests.stages.tools.user_tools" not in STAGES["policy"].runs(tools)  # the user's code, named in params
    for stage in ("policy", "evaluate"):
        assert "stages.builtin.arithmetic_errors" in STAGES[stage].runs(project) \
            and "stages.builtin.arithmetic_errors" not in STAGES[stage].runs()
    assert "stages/builtin/arithmetic_errors.py" in dvc_stages("out", project)["stages"]["policy"]["deps"]
