"""Real model loading from local Hugging Face directories (what a hub id resolves to, offline)."""
import json

import pytest

from stages import runner
from stages.builtin import tiny
from stages.config import ModelConfig, load_params
from stages.models import resolve_model
from tests.conftest import STAGE_ORDER, write_params


@pytest.fixture(scope="module")
def plain_model_dir(tmp_path_factory):
    """A local model folder whose tokenizer has no chat template, like many base models."""
    from transformers import AutoTokenizer

    path = tiny.build(tmp_path_factory.mktemp("plain"), hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, vocab_size=384, seed=1)
    (path / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(path).chat_template is None
    return path


def test_resolve_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder has no config.json"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path)), tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model(ModelConfig(name_or_path="./nope"), tmp_path)
    with pytest.raises(ValueError, match="unknown built-in model"):
        resolve_model(ModelConfig(name_or_path="builtin:huge"), tmp_path)
    assert resolve_model(ModelConfig(name_or_path="org/model"), tmp_path) == "org/model"  # a hub id


def test_local_model_with_text_data_trains(tmp_path, plain_model_dir):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                                              for i in range(60)))
    params = load_params(write_params(tmp_path, {"model": {"name_or_path": str(plain_model_dir)},
                                                 "data": {"source": str(tmp_path / "d.jsonl")},
                                                 "score": {"enabled": False}, "policy": {"method": "none"}}))
    for stage in STAGE_ORDER:
        runner.run_stage(stage, params)
    table = json.loads((tmp_path / "artifacts" / "evaluate" / "metrics.json").read_text())
    assert [r["model"] for r in table] == ["base", "sft", "merged"]  # no preference data, no policy row
    manifest = json.loads((tmp_path / "artifacts" / "sft" / "manifest.json").read_text())
    assert manifest["metrics"]["base_model"]["name_or_path"] == str(plain_model_dir)


def test_conversational_data_without_chat_template_is_a_clear_error(tmp_path, plain_model_dir):
    params = load_params(write_params(tmp_path, {"model": {"name_or_path": str(plain_model_dir)}}))
    with pytest.raises(ValueError, match="the data is conversational .* has no chat template"):
        runner.run_stage("preprocess", params)
