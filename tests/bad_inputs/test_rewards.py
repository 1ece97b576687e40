"""Bad reward-function paths for `score`: refused by name and key, only ever imported, never eval'd."""
from __future__ import annotations

import shutil

import pytest

from tests.bad_inputs.conftest import assert_rejected
from tests.conftest import write_params

M = "tests.bad_inputs.rewards"
CASES = [
    ("missing_module", "nowhere.module:score", [r"score\.reward_functions\[0\] = 'nowhere\.module:score': module "
                                                r"nowhere\.module not found"]),
    ("missing_function", "json:no_such_function", [r"score\.reward_functions\[0\] = 'json:no_such_function': json "
                                                   r"has no attribute 'no_such_function'"]),
    ("not_callable", f"{M}:NOT_CALLABLE", [rf"score\.reward_functions\[0\] = '{M}:NOT_CALLABLE' is a float, "
                                          r"not callable"]),
    ("a_class", "collections:OrderedDict", [r"score\.reward_functions\[0\] = 'collections:OrderedDict' is a class"]),
    ("module_fails_on_import", "tests.bad_inputs.rewards_broken:score",
     [r"score\.reward_functions\[0\] = 'tests\.bad_inputs\.rewards_broken:score': importing "
      r"tests\.bad_inputs\.rewards_broken failed: RuntimeError: reward module misconfigured"]),
    ("code_in_the_path", "os:system('touch pwned')", [r"score\.reward_functions\[0\] = \"os:system\('touch pwned'\)\": "
                                                       r"os has no attribute"]),
    ("wrong_length", f"{M}:wrong_length",
     [rf"reward function '{M}:wrong_length' returned 1 values for 36 completions"]),
    ("not_numbers", f"{M}:strings", [rf"reward function '{M}:strings', row 0: 'good' \(str\) is not a number"]),
    ("not_finite", f"{M}:nan_scores", [rf"reward function '{M}:nan_scores', row 0: nan is not finite"]),
]


@pytest.mark.parametrize("case, function, patterns", CASES, ids=[c[0] for c in CASES])
def test_bad_reward_function(capsys, tmp_path, monkeypatch, built_pipeline, case, function, patterns):
    params, _ = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")  # upstream built; score's previous output kept
    monkeypatch.chdir(tmp_path)  # a path that "ran" would leave ./pwned here
    bad = write_params(tmp_path, {"score": {"reward_functions": [function]}})
    assert_rejected(capsys, bad, "score", *patterns, code=1)
    assert not (tmp_path / "pwned").exists()
