"""`backend: auto | hf | decoder | vllm`: each in-process choice runs what it says, `decoder` refuses a model it
cannot run with `why_not`'s reason, and the stage manifest records the backends that ran."""
import json
import shutil

import pytest

from stages.generation import SamplingParams, generate
from stages.generation.decoder import why_not
from tests.architectures import gpt2

from .conftest import PROMPTS

SAMPLED = SamplingParams(max_new_tokens=6, n=2, do_sample=True, seed=3)


@pytest.mark.parametrize("backend, ran", [("auto", "decoder"), ("decoder", "decoder"), ("hf", "hf")])
def test_each_choice_runs_what_it_says_with_the_same_tokens(model, tok, backend, ran):
    gens = generate(model, tok, PROMPTS, SAMPLED, batch_size=4, backend=backend)
    assert gens.backend == ran
    assert gens.completion_ids == generate(model, tok, PROMPTS, SAMPLED, batch_size=4, backend="hf").completion_ids


def test_beam_search_keeps_generate_under_auto_and_is_refused_by_decoder(model, tok):
    beams = SamplingParams(max_new_tokens=4, num_beams=2)
    assert generate(model, tok, PROMPTS[:2], beams, backend="auto").backend == "hf"
    with pytest.raises(ValueError, match=r"backend = 'decoder' cannot run here: beam search \(num_beams = 2\)"):
        generate(model, tok, PROMPTS[:2], beams, backend="decoder")


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gpt2(tmp_path_factory.mktemp("gpt2"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_an_architecture_the_decoder_does_not_cover(gpt2_model):
    model, tok = gpt2_model
    reason = why_not(model, 64)
    assert reason and "only llama, mistral, qwen2, qwen3 causal LMs" in reason
    assert generate(model, tok, ["1+2", "3+4"], SAMPLED, backend="auto").backend == "hf"
    with pytest.raises(ValueError) as err:
        generate(model, tok, ["1+2", "3+4"], SAMPLED, backend="decoder")
    assert str(err.value) == (f"generation backend = 'decoder' cannot run here: {reason}; set the backend to auto "
                              "(the decoder where it can run, HF generate otherwise) or hf")


def test_an_unknown_backend_in_params_names_the_key_and_the_choices(tmp_path):
    from stages.harness.params_loader import load_params
    from tests.conftest import write_params

    with pytest.raises(Exception) as err:
        load_params(write_params(tmp_path), {"score.generation.backend": "fast"})
    message = str(err.value)
    assert "score.generation.backend" in message and all(c in message for c in ("auto", "hf", "decoder", "vllm"))


@pytest.mark.slow
def test_the_manifest_records_the_backends_that_ran(built_pipeline, tmp_path):
    from stages.harness import runner
    from stages.harness.params_loader import load_params

    params, manifests = built_pipeline
    assert manifests["score"]["generation"] == {"backends": ["decoder"]}  # the default: auto, on the built-in Llama
    assert manifests["evaluate"]["generation"] == {"backends": ["decoder"]}
    assert "generation" not in manifests["sft"]  # a stage that samples nothing records nothing
    copy = tmp_path / "artifacts"
    shutil.copytree(params.run.output_dir, copy, symlinks=True)
    forced = load_params(_params_file(params, tmp_path),
                         {"run.output_dir": str(copy), "score.generation.backend": "hf"})
    manifest = runner.run_stage("score", forced)
    assert manifest["executed"] and manifest["generation"] == {"backends": ["hf"]}
    assert json.loads((copy / "score" / "manifest.json").read_text())["generation"] == {"backends": ["hf"]}
    # computed in shards, the stage run that assembles them samples nothing and still records what the shards ran
    decoder = load_params(_params_file(params, tmp_path), {"run.output_dir": str(copy),
                                                           "score.generation.backend": "decoder",
                                                           "score.generation.batch_size": 6})  # 2 prompt shards
    assert [runner.run_shard("score", decoder, k, 2)["executed"] for k in (0, 1)] == [True, True]
    work = runner.work_dir(decoder, "score", runner.inspect("score", decoder).fingerprint)
    assert sorted(f.name for f in (work / "generation").iterdir()) == ["shard-0-of-2.json", "shard-1-of-2.json"]
    manifest = runner.run_stage("score", decoder)
    assert manifest["executed"] and manifest["generation"] == {"backends": ["decoder"]}


def _params_file(params, folder):
    import yaml

    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False))
    return path
