"""Online sampling shared by online DPO, GRPO and PPO: one seed formula, one settings section, one call."""
import pytest

from stages.trainers.online_sampling import (GENERATION_BACKENDS, GenerationParams, backend_options, sample_online,
                                             sampling_seed)
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def test_backends_and_options():
    assert GENERATION_BACKENDS == ("hf", "vllm")
    assert backend_options(GenerationParams(), "/m") == {}
    vllm = GenerationParams(backend="vllm", vllm_url="http://h:1/v1")
    assert backend_options(vllm, "/m") == {"base_url": "http://h:1/v1", "model": "/m"}  # default: the model's path
    named = GenerationParams(backend="vllm", vllm_model="served")
    assert backend_options(named, "/m")["model"] == "served"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sample_online_is_reproducible_per_seed(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompts = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_preference=3)]
    g = GenerationParams(max_new_tokens=6)
    first = sample_online(model, tok, prompts, g, n=2, seed=sampling_seed(0, 0))
    again = sample_online(model, tok, prompts, g, n=2, seed=sampling_seed(0, 0))
    other = sample_online(model, tok, prompts, g, n=2, seed=sampling_seed(0, 1))
    assert first.prompt_index == [0, 0, 1, 1, 2, 2]  # n completions per prompt, prompt-major
    assert first.completion_ids == again.completion_ids
    assert first.completion_ids != other.completion_ids
    assert all(len(c) <= 6 for c in first.completion_ids)
