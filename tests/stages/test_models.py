"""Real model loading from local Hugging Face directories (what a hub id resolves to, offline)."""
import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest

from stages.builtin import tiny
from stages.harness import runner
from stages.harness.config import ModelConfig
from stages.harness.model_paths import resolve_model
from stages.harness.params_loader import load_params
from stages.model_source import hub_unreachable_reason, model_source_problem
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


def test_resolve_model_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the hub is unreachable
    with pytest.raises(FileNotFoundError, match="folder has no config.json"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path)), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no folder \S+/nope; not a hub id \(org/name\) either, so the hub "
                                                r"was not tried"):
        resolve_model(ModelConfig(name_or_path="./nope"), tmp_path)
    with pytest.raises(ValueError, match="unknown built-in model"):
        resolve_model(ModelConfig(name_or_path="builtin:huge"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"hub id 'org/model' is not in the local Hugging Face cache; the hub "
                                                r"\(http://127.0.0.1:9\) is not reachable"):
        resolve_model(ModelConfig(name_or_path="org/model"), tmp_path)


def fake_hub_cache(cache: Path, repo_id: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/config.json}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return cache


def test_a_cached_hub_id_is_used_offline_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored after the test, as is the constant below
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    cache = fake_hub_cache(tmp_path / "hub", "org/model")
    assert model_source_problem("org/model", cache_dir=cache) is None
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE  # from_pretrained will not retry
    assert "not in the local Hugging Face cache" in model_source_problem("org/other", cache_dir=cache)


def test_hub_reachability_is_answered_in_seconds(tmp_path):
    """A real HTTP server answers (even with an error status); a closed port is refused at once."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert hub_unreachable_reason(f"http://127.0.0.1:{server.server_address[1]}") is None
    finally:
        server.shutdown()
    start = time.monotonic()
    assert "Connection refused" in hub_unreachable_reason("http://127.0.0.1:9")
    assert time.monotonic() - start < 1


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


def test_a_saved_tokenizer_does_not_depend_on_hub_offline_mode(tmp_path, monkeypatch):
    """transformers records `local_files_only` (true under HF_HUB_OFFLINE) in the loaded tokenizer's config; saved
    into a stage's output it made the flow's and the CLI's byte-identical builds differ by the environment."""
    from huggingface_hub import constants

    from stages.harness.config import ModelConfig
    from stages.models import load_tokenizer

    folder = resolve_model(ModelConfig(), tmp_path)
    saved = []
    for offline in (False, True):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        load_tokenizer(folder).save_pretrained(tmp_path / str(offline))
        saved.append((tmp_path / str(offline) / "tokenizer_config.json").read_bytes())
    assert saved[0] == saved[1]
