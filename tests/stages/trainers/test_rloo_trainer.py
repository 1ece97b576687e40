"""RLOOTrainer on the built-in model: weights move, the reward rises on an easy reward, the batch carries leave-one-out
advantages, the KL enters the reward, and TRL's data / padding / TR-DPO settings do what they say."""
from __future__ import annotations

import copy

import pytest
import torch

from stages.losses import rloo_advantages
from stages.trainers import RLOOConfig, RLOOTrainer
from stages.trainers.online_extras import PromptBatchSampler, pad_to_multiple
from stages.trainers.ref_sync import mix_into
from tests.stages.trainers.conftest import build_tiny, builtin_rows

G = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_heads=4)
    return path, builtin_rows("prompts", "prompt_only", num_train=8, num_eval=4)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0, beta=0.0)
    return RLOOConfig(**{**base, **kw})


def low_ids(prompts, completions, completion_ids, **_):
    """Share of completion tokens with an id below 192 (half the vocabulary): easy to learn."""
    return [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def test_every_parameter_changes_and_the_reward_rises(setup, tmp_path):
    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, max_steps=40, learning_rate=3e-2), train_dataset=rows)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(before)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards
    assert all("clip_ratio/region_mean" in h for h in trainer.state.log_history if "reward" in h)


def test_batch_advantages_are_leave_one_out_and_kl_enters_the_reward(setup, tmp_path):
    """beta > 0: the batch's advantages equal rloo_advantages of the rewards with the summed log-ratio to the
    reference; at step 0 the reference is the policy, so kl = 0 and they equal the plain leave-one-out ones."""
    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, beta=0.5), train_dataset=rows)
    batch = trainer.make_batch(rows[:2])
    rewards = torch.tensor(low_ids(None, None, [ids[m.bool()].tolist() for ids, m in
                                                zip(batch["input_ids"][:, -batch["completion_mask"].shape[1]:],
                                                    batch["completion_mask"], strict=True)]))
    torch.testing.assert_close(batch["advantages"], rloo_advantages(rewards, G))
    assert trainer._metrics["kl"] == [0.0]
    assert batch["advantages"].view(-1, G).sum(1).abs().max() < 1e-5  # leave-one-out advantages sum to 0 per group


def test_pad_to_multiple_pads_both_parts_and_keeps_them_masked():
    batch = {"input_ids": torch.tensor([[0, 5, 6, 7, 8]]), "attention_mask": torch.tensor([[0, 1, 1, 1, 1]]),
             "completion_mask": torch.tensor([[1, 1]]), "truncated": torch.tensor([False])}
    out = pad_to_multiple(batch, 4, pad_token_id=0)  # prompt 3 -> 4 columns, completion 2 -> 4 columns
    assert out["input_ids"].tolist() == [[0, 0, 5, 6, 7, 8, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0]]
    assert out["completion_mask"].tolist() == [[1, 1, 0, 0]]
    assert pad_to_multiple(batch, "auto", 0) is batch


def test_shuffle_dataset_false_keeps_dataset_order():
    ordered = list(PromptBatchSampler(6, 2, group=1, repeats=2, seed=0, shuffle=False))
    assert ordered == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    shuffled = list(PromptBatchSampler(6, 2, group=1, repeats=1, seed=0, shuffle=True))
    assert sorted(i for b in shuffled for i in b) == list(range(6)) and shuffled != [[0, 1], [2, 3], [4, 5]]


def test_reference_sync_mixes_the_policy_in():
    ref, policy = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    ref.weight.data[:] = torch.tensor([[0.0, 1.0]])
    policy.weight.data[:] = torch.tensor([[1.0, 3.0]])
    mix_into(ref, policy, 0.6)  # 0.6 * policy + 0.4 * ref
    torch.testing.assert_close(ref.weight.data, torch.tensor([[0.6, 2.2]]))


def test_sync_ref_model_moves_the_reference_during_training(setup, tmp_path):
    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                                               max_steps=2), train_dataset=rows)
    before = copy.deepcopy(trainer.ref_model.state_dict())
    trainer.train()
    assert any(not torch.equal(v, trainer.ref_model.state_dict()[k]) for k, v in before.items())


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        _args(tmp_path, per_device_train_batch_size=3)
    with pytest.raises(ValueError, match="vllm_mode"):
        _args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="sync_ref_model"):
        _args(tmp_path, sync_ref_model=True, beta=0.0)
    with pytest.raises(ValueError, match="reward_clip_range"):
        _args(tmp_path, reward_clip_range=[1.0, 0.0])


def test_use_vllm_server_builds_the_url_from_host_and_port(tmp_path):
    g = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2", vllm_server_port=8123).sampling
    assert (g.backend, g.vllm_url) == ("vllm", "http://10.0.0.2:8123/v1")


def test_evaluate_reports_the_mean_reward_of_num_generations_eval_samples(setup, tmp_path):
    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, num_generations_eval=3, per_device_eval_batch_size=3),
                          train_dataset=rows, eval_dataset=rows[:4])
    calls = []
    scorer = trainer.reward_functions

    def counting(prompts, completions, **columns):
        calls.append(len(completions))
        return scorer(prompts, completions, **columns)

    trainer.reward_functions = counting
    metrics = trainer.evaluate()
    assert calls == [9, 3]  # 4 prompts in batches of 3, 3 completions each
    assert 0 < metrics["eval_reward"] < 1 and metrics["eval_rewards/low_ids/mean"] == metrics["eval_reward"]
    assert metrics["eval_frac_reward_none"] == 0


def test_generation_kwargs_reach_hf_generate_and_override_our_settings(setup, tmp_path):
    """TRL's generation_kwargs: suppress_tokens (an HF generate option, applied before our per-row sampler) keeps
    every sampled id below 192, so the low_ids reward is 1 everywhere; temperature in it overrides ours."""
    path, rows = setup
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    kwargs = {"suppress_tokens": list(range(192, vocab)), "temperature": 0.5}
    args = _args(tmp_path, generation_backend="hf", generation_kwargs=kwargs)
    assert args.sampling.temperature == 0.5
    assert args.sampling.generation_kwargs == {"suppress_tokens": kwargs["suppress_tokens"]}
    trainer = RLOOTrainer(path, low_ids, args, train_dataset=rows)
    batch = trainer.make_batch(rows[:2])
    ids = batch["input_ids"][:, -batch["completion_mask"].shape[1]:][batch["completion_mask"].bool()]
    assert ids.numel() > 0 and int(ids.max()) < 192
    with pytest.raises(ValueError, match="generation_kwargs"):
        _args(tmp_path, generation_kwargs={"suppress_tokens": [5]})  # generation_backend auto: maybe the decoder


def _first_step_grads(path, rows, tmp_path, accumulation: int) -> dict[str, torch.Tensor]:
    """The gradient before the first optimizer step on two prompts, as 2 micro-batches of 1 prompt or 1 of 2."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    grab = Grab()
    args = _args(tmp_path / str(accumulation), max_steps=1, per_device_train_batch_size=2 * G // accumulation,
                 gradient_accumulation_steps=accumulation, beta=0.1)
    RLOOTrainer(path, low_ids, args, train_dataset=rows[:2], callbacks=[grab]).train()
    return grab.grads


def test_accumulation_gives_the_one_batch_gradient(setup, tmp_path):
    """Batch 2 prompts x accumulation 1 = batch 1 prompt x accumulation 2: samples are seeded per prompt, the
    leave-one-out advantages are per group, and the loss is a mean over completions."""
    path, rows = setup
    one, two = _first_step_grads(path, rows, tmp_path, 1), _first_step_grads(path, rows, tmp_path, 2)
    scale = max(g.abs().max().item() for g in one.values())
    assert scale > 0
    assert all(torch.allclose(two[n], g, atol=1e-5 * scale, rtol=1e-4) for n, g in one.items())


def test_steps_per_generation_feeds_several_optimizer_steps(setup, tmp_path):
    """TRL's steps_per_generation = 2 without accumulation: one generation of 2 micro-batches (4 prompts, each with
    its leave-one-out advantages) feeds 2 optimizer steps, so 4 steps generate twice; the second step's samples
    come from the policy before the first update and carry old_logps, whose ratio the clip then bites on."""
    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, max_steps=4, steps_per_generation=2, epsilon=0.05,
                                               learning_rate=5e-2), train_dataset=rows)
    seen = []
    make = trainer.make_batch
    trainer.make_batch = lambda rows: seen.append([r["prompt"] for r in rows]) or make(rows)
    trainer.train()
    assert [len(s) for s in seen] == [4, 4] and len({str(p) for p in seen[0]}) == 4
    assert sorted(trainer._buffer) == [0, 1] and all("old_logps" in b for b in trainer._buffer.values())
    for batch in trainer._buffer.values():  # each slot: per_device_train_batch_size completions, whole groups
        assert batch["advantages"].shape == (2 * G,) and batch["advantages"].view(-1, G).sum(1).abs().max() < 1e-5
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and "reward" in logs[0] and "reward" not in logs[1] and "reward" in logs[2]
    assert logs[0]["clip_ratio/region_mean"] == 0.0 and logs[1]["clip_ratio/region_mean"] > 0.0


def test_generation_batch_size_is_steps_per_generation_in_completions(tmp_path):
    assert _args(tmp_path, generation_batch_size=4 * G).resolved_steps_per_generation == 2
    assert _args(tmp_path, gradient_accumulation_steps=3).resolved_steps_per_generation == 3
    with pytest.raises(ValueError, match="generation_batch_size = 16 and steps_per_generation = 2: set one"):
        _args(tmp_path, generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(ValueError, match="generation_batch_size = 12: must be a multiple of "
                                         "per_device_train_batch_size x processes = 8"):
        _args(tmp_path, generation_batch_size=12)


def test_use_transformers_continuous_batching_samples_with_the_engine(setup, tmp_path):
    """TRL's switch: every generation samples through transformers' continuous batching engine (temperature 1,
    seeded per call); training on those samples moves every weight. use_vllm beside it is refused."""
    import stages.trainers.rloo_trainer as rloo

    path, rows = setup
    trainer = RLOOTrainer(path, low_ids, _args(tmp_path, max_steps=2, use_transformers_continuous_batching=True,
                                               transformers_continuous_batching_config={"page_size": 16}),
                          train_dataset=rows)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen, sample = [], rloo.sample_online
    try:
        rloo.sample_online = lambda *a, **kw: seen.append(sample(*a, **kw)) or seen[-1]
        trainer.train()
    finally:
        rloo.sample_online = sample
    assert [g.backend for g in seen] == ["continuous_batching"] * 2 and all(g.logprobs for g in seen)
    assert {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])} == set(before)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching = True with use_vllm: pick one"):
        _args(tmp_path, use_transformers_continuous_batching=True, use_vllm=True, vllm_mode="server")
