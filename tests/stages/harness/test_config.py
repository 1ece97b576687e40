import subprocess
import sys

import pytest
import yaml

from stages.harness.config import Params
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import ROOT


def test_committed_params_yaml_matches_dataclass_defaults():
    """params.yaml is complete: every section and key, no unknown ones; values equal the documented defaults."""
    params = load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(raw) == set(Params().to_dict())
    assert params.to_dict() == Params().to_dict()


def test_every_problem_listed_with_dotted_key(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["sft"]["learning_rate"] = -1e-4
    raw["sft"]["lr_scheduler_type"] = "triangle"
    raw["sft"]["num_train_epochs"] = "three"
    raw["sft"]["bogus"] = 1
    raw["model"]["builtin"]["num_heads"] = 3
    raw["data"]["on_bad_rows"] = "ignore"
    raw["nonsense"] = {}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "p.yaml")
    msg = str(e.value)
    assert len(e.value.problems) == 7, msg
    for key in ("sft.learning_rate = -0.0001: must be > 0", "sft.lr_scheduler_type = 'triangle'",
                "sft.num_train_epochs = 'three': expected a number", "sft.bogus: unknown key",
                "data.on_bad_rows = 'ignore'", "nonsense: unknown key",
                "model.builtin.num_heads = 3: must divide hidden_size"):
        assert key in msg, key


def test_cross_field_rule(tmp_path):
    with pytest.raises(ParamsError, match=r"model.builtin.num_heads = 3: must divide hidden_size \(128\)"):
        load_params(ROOT / "params.yaml", ["model.builtin.num_heads=3"])


def test_overrides_parse_yaml_values():
    p = load_params(ROOT / "params.yaml", ["sft.learning_rate=1e-4", "sft.report_to=[tensorboard]",
                                           "data.eval_source=null", "evaluate.baseline=false"])
    assert p.sft.learning_rate == 1e-4 and isinstance(p.sft.learning_rate, float)
    assert p.sft.report_to == ["tensorboard"]
    assert p.evaluate.baseline is False


def test_override_unknown_key_and_malformed():
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", ["sft.learning_rat=1e-4", "novalue"])
    assert "sft.learning_rat: unknown key" in str(e.value)
    assert "--set 'novalue': expected KEY=VALUE" in str(e.value)


def test_select_dotted_keys():
    p = Params()
    sel = p.select(("sft", "run.seed"))
    assert sel["run.seed"] == 0 and sel["sft"]["learning_rate"] == p.sft.learning_rate


def test_cli_bad_params_exit_code_and_nothing_written(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["run"]["output_dir"] = str(tmp_path / "artifacts")
    raw["sft"]["learning_rate"] = -1
    raw["evaluate"]["answer_regex"] = "("
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    res = subprocess.run([sys.executable, "-m", "stages", "preprocess", "--params", str(tmp_path / "params.yaml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2
    assert "sft.learning_rate = -1: must be > 0" in res.stderr
    assert "evaluate.answer_regex" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "artifacts").exists()


def test_a_partial_params_file_renders_into_a_full_one_that_loads_the_same(tmp_path):
    """`align params --from configs/smollm2.yaml --write`: params.yaml with the recipe's values (and the defaults for
    every key the recipe leaves out), so `dvc repro` runs the recipe; loading either file gives the same params."""
    from stages.__main__ import main

    recipe = ROOT / "configs" / "smollm2.yaml"
    out = tmp_path / "params.yaml"
    assert main(["params", "--from", str(recipe), "--params", str(out), "--write"]) == 0
    assert load_params(out, preflight=False) == load_params(recipe, preflight=False)
    assert load_params(out, preflight=False) != load_params(ROOT / "params.yaml", preflight=False)
    assert "name_or_path: builtin:smollm2-135m-instruct" in out.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: {learning_rate: -1}\n")
    assert main(["params", "--from", str(bad), "--params", str(tmp_path / "x.yaml"), "--write"]) == 2
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_params_file_validates(recipe):
    """The recipes under configs/ (README and docs/benchmarks.md run each with `--params`) load and pass
    validation (with the `--set` their header asks for): a key renamed in a config class breaks them here, not in a
    user's run."""
    asked = {"evaluation.yaml": {"evaluate.judge.model": "the-served-judge"}}  # the server's model name
    params = load_params(ROOT / "configs" / recipe, asked.get(recipe, {}), preflight=False)
    assert params.run.seed is not None
