"""Online sampling shared by online DPO, GRPO and PPO: one seed formula, one settings section, one call."""
import pytest

from stages.basics import stable_seed
from stages.trainers.online_generation import (
    GENERATION_BACKENDS,
    GenerationParams,
    backend_options,
    sample_online,
)
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def test_backends_and_options():
    assert GENERATION_BACKENDS == ("auto", "hf", "decoder", "vllm", "continuous_batching")
    assert GenerationParams().backend == "auto"
    assert backend_options(GenerationParams(), "/m") == {}
    assert backend_options(GenerationParams(backend="continuous_batching", continuous_batching_config={"page_size": 8}),
                           "/m") == {"config": {"page_size": 8}}
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
    first = sample_online(model, tok, prompts, g, n=2, seed=stable_seed(0, 0))
    again = sample_online(model, tok, prompts, g, n=2, seed=stable_seed(0, 0))
    other = sample_online(model, tok, prompts, g, n=2, seed=stable_seed(0, 1))
    assert first.prompt_index == [0, 0, 1, 1, 2, 2]  # n completions per prompt, prompt-major
    assert first.completion_ids == again.completion_ids
    assert first.completion_ids != other.completion_ids
    assert all(len(c) <= 6 for c in first.completion_ids)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainers_sample_with_the_run_seed_and_the_optimizer_step(tmp_path):
    """GRPO and PPO at global step 5 sample a prompt as `sample_online` with stable_seed(run seed, 5) samples it
    alone: the draw is the (global, resumable) optimizer step, and the trainer's batch does not enter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer
    from stages.trainers.ppo_trainer import PPOConfig, PPOTrainer

    path = build_tiny(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(path)
    rows = builtin_rows("prompts", "prompt", num_preference=4)[:4]
    g = GenerationParams(max_new_tokens=5)
    common = dict(report_to="none", use_cpu=True, save_strategy="no", seed=7, generation=g)

    def alone(model, n):
        return sample_online(model, tok, [rows[2]["prompt"]], g, n=n, seed=stable_seed(7, 5)).completion_ids

    grpo = GRPOTrainer(AutoModelForCausalLM.from_pretrained(path), ["exact_match"], processing_class=tok,
                       train_dataset=rows, args=GRPOConfig(output_dir=str(tmp_path / "g"), num_generations=2,
                                                           per_device_train_batch_size=8, **common))
    grpo.state.global_step = 5
    batch = grpo.make_batch(rows)
    width = batch["completion_mask"].shape[1]
    got = [batch["input_ids"][i, -width:][batch["completion_mask"][i].bool()].tolist() for i in (4, 5)]
    assert got == alone(grpo.model, 2)

    ppo = PPOTrainer(AutoModelForCausalLM.from_pretrained(path), args=PPOConfig(
        output_dir=str(tmp_path / "p"), per_device_train_batch_size=4, **common), processing_class=tok,
        train_dataset=rows, reward_funcs=["exact_match"])
    ppo.state.global_step = 5
    _, completions, _, _ = ppo.sample(ppo.model, rows)  # (prompts, completions, scores, sampler log-probs)
    assert completions[2:3] == alone(ppo.model.pretrained_model, 1)
