"""Stage `policy` (DPO) on the built-in pairs: starts from the SFT model, saves a loadable model."""
import json

import pytest

from stages import runner
from stages.config import load_params
from tests.conftest import write_params


def test_dpo_stage_outputs(built_pipeline):
    params, manifests = built_pipeline
    m = manifests["policy"]["metrics"]
    assert m["method"] == "dpo" and m["steps"] == 3 and m["pairs"] > 0
    assert m["last_reward_accuracy"] is not None
    assert "model/model.safetensors" in manifests["policy"]["outputs"]["files"]
    assert manifests["policy"]["inputs"]["sft"]["outputs_hash"] == manifests["sft"]["outputs"]["hash"]


def test_no_preference_pairs_is_a_clear_error(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                                              for i in range(60)))
    params = load_params(write_params(tmp_path, {"data": {"source": str(tmp_path / "d.jsonl")}}))
    for stage in ("preprocess", "sft"):
        runner.run_stage(stage, params)
    with pytest.raises(ValueError, match="no preference pairs; policy.method = dpo needs prompt/chosen/rejected"):
        runner.run_stage("policy", params)
