"""Bad model paths: missing, not a model, broken, the wrong architecture, custom code without consent."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.bad_inputs.conftest import assert_rejected, escape

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def test_missing_model_folder(capsys, tmp_path, params_for):
    """Found at params validation (exit 2), before the stage runs; tests/bad_inputs/test_last_line.py has the
    relative, ./, ~ and org/name forms."""
    params = params_for({"model": {"name_or_path": str(tmp_path / "no-model")}})
    assert_rejected(capsys, params, "preprocess", r"model\.name_or_path = '" + escape(tmp_path / "no-model")
                    + r"': no folder " + escape(tmp_path / "no-model") + "; not a hub id", code=2)


def test_folder_that_is_not_a_model(capsys, tmp_path, params_for):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    params = params_for({"model": {"name_or_path": str(folder)}})
    assert_rejected(capsys, params, "preprocess", r"model\.name_or_path = '" + escape(folder)
                    + r"': folder has no config\.json", code=2)


def test_unparseable_config(capsys, tmp_path, params_for, model_dir):
    folder = copy_tokenizer(model_dir, tmp_path / "broken")
    (folder / "config.json").write_text('{"model_type": "llama", ')
    params = params_for({"model": {"name_or_path": str(folder)}})
    assert_rejected(capsys, params, "preprocess", escape(folder), r"config\.json", code=1)


def _preprocessed(tmp_path, params_for, folder: Path):
    """Params using `folder` as the model, with preprocess already built (it only needs the tokenizer)."""
    params = params_for({"model": {"name_or_path": str(folder)}})
    runner.run_stage("preprocess", load_params(params))
    return params


def test_model_without_weights(capsys, tmp_path, params_for, model_dir):
    folder = copy_tokenizer(model_dir, tmp_path / "no-weights")
    shutil.copy(model_dir / "config.json", folder / "config.json")
    params = _preprocessed(tmp_path, params_for, folder)
    assert_rejected(capsys, params, "sft", escape(folder), r"no model weights|model\.safetensors", code=1)


def test_wrong_architecture_for_the_stage(capsys, tmp_path, params_for, model_dir):
    """An encoder (DistilBERT) where sft needs a causal language model."""
    from transformers import DistilBertConfig, DistilBertModel

    folder = copy_tokenizer(model_dir, tmp_path / "encoder")
    DistilBertModel(DistilBertConfig(vocab_size=384, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
                    ).save_pretrained(folder)
    params = _preprocessed(tmp_path, params_for, folder)
    assert_rejected(capsys, params, "sft", escape(folder), r"a DistilBertConfig model is not a causal language model",
                    code=1)


def test_custom_code_needs_trust_remote_code(capsys, tmp_path, params_for, model_dir):
    """A model folder whose config needs its own modelling code (auto_map) is refused at params validation
    (exit 2, before anything is built or loaded) unless model.trust_remote_code is set: the code is never
    imported (the marker file it would write stays absent)."""
    folder = copy_tokenizer(model_dir, tmp_path / "custom")
    marker = tmp_path / "custom-code-ran"
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="align_custom", auto_map={"AutoConfig": "modeling_custom.CustomConfig",
                                                        "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    params = params_for({"model": {"name_or_path": str(folder)}})
    assert_rejected(capsys, params, "preprocess", r"model\.name_or_path = '" + escape(folder) + r"': config\.json "
                    r"needs custom code \(auto_map: AutoConfig -> modeling_custom\.CustomConfig, AutoModelForCausalLM "
                    r"-> modeling_custom\.CustomModel\), and model\.trust_remote_code is false: loading would run "
                    r"code from the model folder\. Read that code, then set model\.trust_remote_code: true if you "
                    r"trust it",
                    code=2)
    assert not marker.exists() and not (tmp_path / "artifacts").exists()
    load_params(params, ["model.trust_remote_code=true"])  # consent given: validation lets it through
    assert not marker.exists()


def test_custom_tokenizer_code_needs_trust_remote_code(tmp_path, params_for, model_dir):
    """The same for a tokenizer that names its own class (tokenizer_config.json's auto_map)."""
    import pytest

    from stages.harness.params_loader import ParamsError

    folder = copy_tokenizer(model_dir, tmp_path / "custom-tok")
    shutil.copy(model_dir / "config.json", folder / "config.json")
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ParamsError, match=r"tokenizer_config\.json needs custom code \(auto_map: AutoTokenizer -> "
                                          r"tokenization_x\.XTokenizer\), and model\.trust_remote_code is false"):
        load_params(params_for({"model": {"name_or_path": str(folder)}}))
