"""stages.sampling: the one sampling record, from each config (or score's section) to the backend."""
import dataclasses

import pytest

from stages.sampling import GENERATION_BACKENDS, SamplingParams, backend_options


def test_backends_are_the_generation_packages():
    from stages.generation import BACKENDS

    assert set(GENERATION_BACKENDS) == set(BACKENDS)


def test_backend_and_batch_size_are_checked_with_the_decoding_settings():
    with pytest.raises(ValueError) as e:
        SamplingParams(backend="tgi", batch_size=0, n=3)
    text = str(e.value)
    assert "SamplingParams.backend = 'tgi': unknown; supported: auto, hf, decoder, vllm" in text
    assert "SamplingParams.batch_size = 0: must be an int >= 1" in text
    assert "SamplingParams.n = 3 with greedy decoding" in text  # all problems in one error


def test_backend_options_name_the_server_and_its_model():
    assert backend_options(SamplingParams(), "/m") == {}
    assert backend_options(SamplingParams(backend="vllm", vllm_url="http://h:1/v1"), "/m") == {
        "base_url": "http://h:1/v1", "model": "/m"}
    assert backend_options(SamplingParams(backend="vllm", vllm_model="served"), "/m")["model"] == "served"


@pytest.mark.parametrize(("module", "name", "fields", "n"), [
    ("grpo_config", "GRPOConfig", {"num_generations": 6, "per_device_train_batch_size": 12}, 6),
    ("rloo_config", "RLOOConfig", {"num_generations": 3, "per_device_train_batch_size": 6}, 3),
    ("online_dpo_config", "OnlineDPOConfig", {}, 2),
    ("ppo_config", "PPOConfig", {}, 1),
    ("distillation_config", "DistillationConfig", {}, 1),
])
def test_each_online_config_gives_its_completions_per_prompt_as_n(module, name, fields, n):
    import importlib

    config = getattr(importlib.import_module(f"stages.trainers.{module}"), name)
    args = config(output_dir="unused", report_to="none", temperature=0.7, min_p=None, **fields)
    s = args.sampling
    assert isinstance(s, SamplingParams)
    assert (s.n, s.do_sample, s.temperature, s.min_p) == (n, True, 0.7, 0.0)  # min_p null: off


def test_scores_section_reaches_the_sampler_whole():
    """score.generation's every setting (min_p, repetition_penalty, ... included) is in the record score samples
    with; score.n is its n."""
    from stages.harness.config import GenerationParams

    section = GenerationParams(max_new_tokens=9, temperature=0.5, min_p=0.1, repetition_penalty=1.2,
                               generation_kwargs={"no_repeat_ngram_size": 2}, cache_implementation="static",
                               backend="hf", batch_size=7)
    s = section.sampling(4, seed=11)
    assert dataclasses.asdict(s) == {**dataclasses.asdict(section), "n": 4, "seed": 11, "do_sample": True,
                                     "num_beams": 1}
    assert GenerationParams().sampling(2, seed=0).min_p == 0.0
