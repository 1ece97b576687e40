"""`align run` checks the trainer configs of the training stages it will train only: with every stage current it
imports no torch before the flow, and a changed training key brings its section's check back."""
from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT

PROBE = """
import sys
from stages.harness.params_loader import load_params
from stages.harness.preflight import stale_training_stages, trainer_config_problems
params = load_params(sys.argv[1], sys.argv[2:])
stale = stale_training_stages(params)
problems = trainer_config_problems(params, stale)
print(sorted(stale), problems, 'torch' in sys.modules)
"""


def probe(params_file, *overrides: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", PROBE, str(params_file), *overrides], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def test_current_stages_skip_the_trainer_config_check(built_pipeline, tmp_path):
    params, _ = built_pipeline
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False))
    assert probe(params_file) == "[] [] False"  # all current: nothing to check, torch never imported
    # a changed policy key: policy is stale, its section is checked (transformers imported), SFT's is not
    assert probe(params_file, "policy.dpo.beta=0.2") == "['policy'] [] True"
    refused = probe(params_file, "policy.dpo.load_best_model_at_end=true")  # transformers refuses it (no eval)
    assert refused.startswith("['policy'] ['policy.dpo.") and refused.endswith("True"), refused
