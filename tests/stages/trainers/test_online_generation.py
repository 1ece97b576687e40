"""Online sampling shared by online DPO, GRPO and PPO: one seed formula, one settings section, one call."""
import dataclasses

import pytest

from stages.basics import stable_seed
from stages.sampling import SamplingParams
from stages.trainers.online_generation import GENERATION_BACKENDS, backend_options, sample_online
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def test_backends_and_options():
    assert GENERATION_BACKENDS == ("auto", "hf", "decoder", "vllm", "continuous_batching")
    assert SamplingParams().backend == "auto"
    assert backend_options(SamplingParams(), "/m") == {}
    assert backend_options(SamplingParams(backend="continuous_batching", continuous_batching_config={"page_size": 8}),
                           "/m") == {"config": {"page_size": 8}}
    vllm = SamplingParams(backend="vllm", vllm_url="http://h:1/v1")
    assert backend_options(vllm, "/m") == {"base_url": "http://h:1/v1", "model": "/m"}  # default: the model's path
    named = SamplingParams(backend="vllm", vllm_model="served")
    assert backend_options(named, "/m")["model"] == "served"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sample_online_is_reproducible_per_seed(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompts = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_preference=3)]
    g = SamplingParams(max_new_tokens=6, n=2, do_sample=True)
    first = sample_online(model, tok, prompts, g, seed=stable_seed(0, 0))
    again = sample_online(model, tok, prompts, g, seed=stable_seed(0, 0))
    other = sample_online(model, tok, prompts, g, seed=stable_seed(0, 1))
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
    g = SamplingParams(max_new_tokens=5, do_sample=True)
    common = dict(report_to="none", use_cpu=True, save_strategy="no", seed=7, max_completion_length=5)

    def alone(model, n):
        return sample_online(model, tok, [rows[2]["prompt"]], dataclasses.replace(g, n=n),
                             seed=stable_seed(7, 5)).completion_ids

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


def test_one_sampling_record_carries_n_from_the_config_to_the_backend():
    """Each method's params section (its config, read torch-free) gives the backend's record with its completions
    per prompt under the backend's name, n: GRPO's num_generations, online DPO's pair, PPO's one rollout; score's
    section gives score.n the same way."""
    from stages.harness.config import Params

    params = Params()
    policy = params.policy
    policy.grpo.num_generations, policy.grpo.max_completion_length, policy.grpo.temperature = 6, 9, 0.7
    grpo = policy.grpo.sampling
    assert isinstance(grpo, SamplingParams)
    assert (grpo.n, grpo.max_new_tokens, grpo.temperature, grpo.do_sample) == (6, 9, 0.7, True)
    assert policy.online_dpo.sampling.n == 2 and policy.online_dpo.sampling.max_new_tokens == 64
    assert policy.ppo.sampling.n == 1
    score = params.score.generation.sampling(params.score.n, seed=5)
    assert (score.n, score.seed, score.batch_size, score.backend) == (4, 5, 64, "auto")
    with pytest.raises(ValueError, match="SamplingParams.backend = 'fast': unknown"):
        SamplingParams(backend="fast")
