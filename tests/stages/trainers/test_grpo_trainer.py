"""GRPOTrainer on the built-in model: weights move, masks keep padding and post-EOS tokens out of the loss,
unscored and equal-reward groups get zero advantage, the num_iterations / reference / reward-head paths work."""
import copy

import pytest
import torch

from stages.losses import grpo_advantages, grpo_loss
from stages.trainers.grpo_trainer import (
    REWARD_HEAD_FILE,
    GRPOConfig,
    GRPOTrainer,
    RepeatBatchSampler,
    RewardHead,
    completion_tensors,
    per_token_logps,
)
from tests.stages.trainers.conftest import build_tiny, builtin_rows

G = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_heads=4)
    prompts = builtin_rows("prompts", "prompt_only", num_train=4, num_eval=4)
    pairs = builtin_rows("preference", "preference", num_train=4, num_eval=4)
    return path, AutoTokenizer.from_pretrained(path), prompts, pairs


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2 * G, num_generations=G,
                max_completion_length=12, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0)
    return GRPOConfig(**{**base, **kw})


def low_ids(prompts, completions, completion_ids, **_):
    """Share of completion tokens with an id below 192 (half the vocabulary): about 0.5 with a wide spread on
    the untrained model (which rarely stops before generation.max_new_tokens), and easy to learn."""
    return [sum(t < 192 for t in ids) / len(ids) for ids in completion_ids]


def constant(prompts, completions, **_):
    return [1.0] * len(completions)


def _changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def test_smoke_every_parameter_changes_and_metrics_are_logged(setup, tmp_path):
    path, tok, prompts, _ = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, ["exact_match", ("low_ids", low_ids)], processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, max_steps=16, reward_weights=[1.0, 1.0],
                                                  lr_scheduler_type="constant"))
    trainer.train()
    assert _changed(model, before) == set(before)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 16 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    for key in ("rewards/low_ids/mean", "rewards/exact_match/mean", "frac_reward_zero_std", "entropy",
                "clip_ratio/region_mean", "completions/mean_length", "completions/truncated_ratio",
                "timing/generation_s", "timing/scoring_s", "timing/training_s", "timing/tokens_per_s"):
        assert key in logs[-1], key
    assert logs[0]["completions/max_length"] <= 12 and logs[0]["entropy"] > 0
    first, last = (sum(h["reward"] for h in part) / 4 for part in (logs[:4], logs[-4:]))
    # the policy learns to emit low ids; gains over run seeds 0-3 ranged 0.03-0.16 (either sampler): 0.05, not 0.1
    assert last > first + 0.05, (first, last)
    assert trainer.timing["generation_s"] > 0 and trainer.timing["generated_tokens"] > 0


def test_completion_masks_with_pad_equal_to_eos():
    """pad = EOS = 2. Row 0 ends in EOS; row 1 has tokens after its first EOS; row 2 was cut (no EOS) and is
    shorter than the batch, so its padding (EOS ids!) must not count as an emitted EOS."""
    out = completion_tensors([[9, 8], [7], [9, 8]], [[5, 6, 2], [7, 2, 8, 9], [5, 6]], pad_token_id=2, eos_token_id=2)
    assert out["input_ids"][:, 2:].tolist() == [[5, 6, 2, 2], [7, 2, 8, 9], [5, 6, 2, 2]]
    assert out["completion_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert out["truncated"].tolist() == [False, False, True]
    assert out["input_ids"][:, :2].tolist() == [[9, 8], [2, 7], [9, 8]]  # prompts left-padded
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("chunked", [True, False])
def test_padding_and_tokens_after_eos_never_reach_the_loss(setup, chunked):
    """Changing every token after the first EOS (and the padding) leaves logps, loss and gradients unchanged."""
    path, tok, _, _ = setup
    model = _model(path)
    eos = tok.eos_token_id
    prompt = [[tok.convert_tokens_to_ids("<|user|>"), 40, 41]] * 2
    a = completion_tensors(prompt, [[40, 41, eos, 42, 43], [44, eos]], pad_token_id=eos, eos_token_id=eos)
    b = completion_tensors(prompt, [[40, 41, eos, 99, 98], [44, eos, 97]], pad_token_id=eos, eos_token_id=eos)
    assert a["completion_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert torch.equal(a["completion_mask"], b["completion_mask"][:, :5])
    results = []
    for batch in (a, b):
        model.zero_grad()
        logps, _ = per_token_logps(model, batch, chunked=chunked)
        assert (logps[batch["completion_mask"] == 0] == 0).all()
        loss, _ = grpo_loss(logps, None, None, torch.tensor([1.0, -1.0]), batch["completion_mask"], beta=0.0)
        loss.backward()
        results.append((logps[:, :3].detach(), loss.detach(), model.lm_head.weight.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    assert torch.allclose(results[0][2], results[1][2], atol=1e-6)


def test_chunked_and_logits_logps_agree_with_a_plain_forward(setup):
    path, tok, _, _ = setup
    model = _model(path)
    eos = tok.eos_token_id
    batch = completion_tensors([[30, 31, 32], [33]], [[40, 41, eos], [44, 45, 46, 47]], pad_token_id=tok.pad_token_id,
                               eos_token_id=eos)
    fast, ent_fast = per_token_logps(model, batch, temperature=0.7, chunked=True, entropy=True)
    slow, ent_slow = per_token_logps(model, batch, temperature=0.7, chunked=False, entropy=True)
    assert torch.allclose(fast, slow, atol=1e-5) and torch.allclose(ent_fast, ent_slow, atol=1e-5)
    # Row 1 on its own, unpadded: the left padding of its prompt must not change anything.
    ids = torch.tensor([[33, 44, 45, 46, 47]])
    ref = (model(ids).logits[0, :-1] / 0.7).log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(fast[1], ref, atol=1e-5)


def test_unscored_rows_are_excluded(setup, tmp_path):
    """Completion 0 of each group is unscored (None): advantage 0, no loss tokens; the others' advantages are
    those of their group without it."""
    path, tok, prompts, _ = setup

    def partial(prompts, completions, completion_ids, **_):
        return [None if i % G == 0 else -len(c) for i, c in enumerate(completion_ids)]

    trainer = GRPOTrainer(_model(path), partial, processing_class=tok, train_dataset=prompts, args=_args(tmp_path))
    batch = trainer.make_batch(prompts[:2])
    lengths = batch["completion_mask"].sum(1).float()
    valid = torch.tensor([i % G != 0 for i in range(2 * G)])
    expected = grpo_advantages(-lengths, G, valid=valid)
    assert torch.allclose(batch["advantages"], expected)
    assert (batch["advantages"][~valid] == 0).all() and (batch["loss_mask"][~valid] == 0).all()
    assert torch.equal(batch["loss_mask"][valid], batch["completion_mask"][valid])
    # Dropping the unscored rows gives the same advantages as never generating them (G - 1 per group).
    assert torch.allclose(batch["advantages"][valid], grpo_advantages(-lengths[valid], G - 1))
    assert trainer._metrics["frac_reward_none"] == [pytest.approx(0.25)]


def test_mask_truncated_completions(setup, tmp_path):
    """Completions cut at max_completion_length (no EOS) get no loss; the others keep their completion mask."""
    path, tok, prompts, _ = setup
    trainer = GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, mask_truncated_completions=True,
                                                                  max_completion_length=4))
    batch = trainer.make_batch(prompts[:4])
    cut = batch["truncated"]
    assert cut.any() and (batch["loss_mask"][cut] == 0).all()
    assert torch.equal(batch["loss_mask"][~cut], batch["completion_mask"][~cut])
    assert (batch["completion_mask"].sum(1)[cut] == 4).all()  # the cut ones are exactly max_new_tokens


def test_equal_rewards_give_zero_advantage_and_no_update(setup, tmp_path):
    path, tok, prompts, _ = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, constant, processing_class=tok, train_dataset=prompts, args=_args(tmp_path,
                          max_steps=1))
    trainer.train()
    log = next(h for h in trainer.state.log_history if "reward" in h)
    assert log["frac_reward_zero_std"] == 1.0 and log["reward"] == 1.0 and log["reward_std"] == 0.0
    assert (trainer._buffer[0]["advantages"] == 0).all()
    assert not _changed(model, before)  # zero advantage, no KL: a zero gradient


def test_num_iterations_reuses_each_generation(setup, tmp_path):
    """num_iterations = 2: 4 steps, 2 generations; the reused batch carries the sampler's log-probs, and on its
    second update the policy has moved, so the importance ratio departs from 1 (some tokens clipped at lr 1e-2)."""
    path, tok, prompts, _ = setup
    trainer = GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, num_iterations=2, epsilon=0.05))
    seen = []
    make = trainer.make_batch
    trainer.make_batch = lambda rows: seen.append([r["prompt"] for r in rows]) or make(rows)
    trainer.train()
    assert len(seen) == 2 and "old_logps" in trainer._buffer[0]
    logs = [h for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert logs[0]["clip_ratio/region_mean"] == 0.0  # first update of a generation: ratio exactly 1
    assert logs[1]["clip_ratio/region_mean"] > 0.0
    sampler = RepeatBatchSampler(10, 3, group=2, repeats=2, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 8 and batches[0:2] == batches[2:4] and batches[4:6] == batches[6:8]
    assert sorted(i for b in batches[0:2] + batches[4:6] for i in b) == list(range(10))


def test_beta_uses_a_frozen_reference(setup, tmp_path):
    path, tok, prompts, _ = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, beta=0.5, max_steps=3))
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0  # equal at the start, apart after updates
    assert all(torch.equal(p, before[n]) for n, p in trainer.ref_model.named_parameters())
    assert _changed(model, before)


def test_lora_reference_is_the_adapter_disabled_base(setup, tmp_path):
    from peft import LoraConfig, get_peft_model

    path, tok, prompts, _ = setup
    model = get_peft_model(_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer = GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, beta=0.1, max_steps=2))
    assert trainer.ref_model is None
    trainer.train()
    batch = trainer.make_batch(prompts[:2])
    base, _ = per_token_logps(_model(path), batch)
    assert torch.allclose(batch["ref_logps"], base, atol=1e-5)


def test_shared_reward_head_trains_saves_and_loads(setup, tmp_path):
    path, tok, prompts, pairs = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head = RewardHead(model.config.hidden_size)
    head_before = copy.deepcopy(head.state_dict())
    trainer = GRPOTrainer(model, None, processing_class=tok, train_dataset=prompts, preference_dataset=pairs,
                          reward_head=head, args=_args(tmp_path, reward_head="shared", max_steps=8,
                                                       reward_head_batch_size=16, learning_rate=5e-3))
    trainer.train()
    assert not any(torch.equal(head.state_dict()[k], v) for k, v in head_before.items())
    assert _changed(model, before)
    logs = [h for h in trainer.state.log_history if "reward_head/loss" in h]
    assert "rewards/reward_head/mean" in logs[0] and logs[-1]["reward_head/loss"] < logs[0]["reward_head/loss"]
    trainer.save_model(str(tmp_path / "out"))
    loaded = RewardHead.load(tmp_path / "out")
    assert (tmp_path / "out" / REWARD_HEAD_FILE).exists()
    assert all(torch.equal(loaded.state_dict()[k], v.cpu()) for k, v in head.state_dict().items())


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="num_generations = 1: must be >= 2"):
        _args(tmp_path, num_generations=1)
    with pytest.raises(ValueError, match="per_device_train_batch_size = 6: counts completions and must be "
                                         "divisible by num_generations = 4"):
        _args(tmp_path, per_device_train_batch_size=6)
    with pytest.raises(ValueError, match=r"epsilon_high = 0.1: must be >= epsilon \(0.2\)") as err:
        _args(tmp_path, epsilon_high=0.1, loss_type="ppo", scale_rewards="std",
              top_p=0.0, generation_backend="tgi")
    # all problems at once
    assert "loss_type = 'ppo': expected one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'" in str(err.value)
    assert "scale_rewards = 'std'" in str(err.value)
    assert "top_p = 0.0: must be in (0, 1]" in str(err.value)
    assert "generation_backend = 'tgi': expected one of 'auto', 'hf', 'decoder', 'vllm'" in str(err.value)


def test_bad_trainer_inputs(setup, tmp_path):
    path, tok, prompts, _ = setup
    with pytest.raises(ValueError, match="rows with a 'prompt' column; 1 of 1"):
        GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=[{"question": "1+1"}],
                    args=_args(tmp_path))
    with pytest.raises(ValueError, match=r"1 weight\(s\) for 2 reward function\(s\)"):
        GRPOTrainer(_model(path), [low_ids, constant], processing_class=tok, train_dataset=prompts,
                    args=_args(tmp_path, reward_weights=[1.0]))
    with pytest.raises(ValueError, match="reward_head = 'shared' needs preference_dataset"):
        GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                    args=_args(tmp_path, reward_head="shared"))
    trainer = GRPOTrainer(_model(path), lambda p, c, **_: [float("nan")] * len(c), processing_class=tok,
                          train_dataset=prompts, args=_args(tmp_path))
    with pytest.raises(ValueError, match="reward function '<lambda>', row 0: nan is not finite"):
        trainer.make_batch(prompts[:2])
    trainer = GRPOTrainer(_model(path), ("one", lambda p, c, **_: [1.0]), processing_class=tok,
                          train_dataset=prompts, args=_args(tmp_path))
    with pytest.raises(ValueError, match="reward function 'one' returned 1 values for 8 completions"):
        trainer.make_batch(prompts[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trains_on_gpu_with_beta_and_iterations(setup, tmp_path):
    """Every tensor of the generation phase lands on the GPU (generation, masks, old / reference log-probs)."""
    path, tok, prompts, _ = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                          args=_args(tmp_path, use_cpu=False, beta=0.1, num_iterations=2))
    trainer.train()
    assert trainer._buffer[0]["advantages"].is_cuda and trainer._buffer[0]["ref_logps"].is_cuda
    assert _changed(model, {n: p.to(model.device) for n, p in before.items()})


def test_resume_between_iterations_reuses_the_buffered_rollouts_and_the_pair_rng(setup, tmp_path):
    """A run resumed from checkpoint-1 (num_iterations 2: step 2 reuses step 1's rollouts, both micro-batches of
    it, generated by the step's first micro-batch; the shared reward head draws its preference minibatches from a
    private generator) ends exactly as the uninterrupted run."""
    from safetensors import safe_open

    path, tok, prompts, pairs = setup
    head = RewardHead(_model(path).config.hidden_size)

    def trainer(folder):
        args = _args(folder, max_steps=4, num_iterations=2, reward_head="shared", reward_head_batch_size=4,
                     save_strategy="steps", save_steps=1, learning_rate=5e-3, per_device_train_batch_size=G,
                     gradient_accumulation_steps=2)
        return GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                           preference_dataset=pairs, reward_head=copy.deepcopy(head), args=args)

    clean = trainer(tmp_path / "clean")
    clean.train()
    checkpoint = tmp_path / "clean" / "checkpoint-1"
    with safe_open(str(checkpoint / "rollout_state_0.safetensors"), framework="pt") as f:
        assert "pair_rng" in f.keys() and {k.split(".")[1] for k in f.keys() if k.startswith("buffer.")} == {"0", "1"}
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def logged(t):
        keys = ("loss", "reward", "reward_head/loss")  # reward: on the steps that generate (1 and 3)
        return {h["step"]: [h[k] for k in keys if k in h] for h in t.state.log_history if "loss" in h}

    a, b = logged(clean), logged(resumed)
    assert sorted(b) == [1, 2, 3, 4] and all(b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-9) for s in b), (a, b)
    for (name, p), q in zip(clean.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    for k, v in clean.reward_head.state_dict().items():
        assert torch.allclose(v, resumed.reward_head.state_dict()[k], atol=1e-6), k


def _first_step(path, tok, prompts, tmp_path, *, loss_type, accumulation):
    """One optimizer step on two prompts (G completions each), as 2 micro-batches of 1 prompt or 1 of 2:
    (the gradient before the optimizer step, each micro-batch's loss-token count)."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    def some_unscored(prompts, completions, completion_ids, **_):
        """Unscored when the first token id is a multiple of 4: a property of the completion alone, the same in
        both layouts; it leaves the micro-batches with unequal loss-token counts."""
        return [None if ids[0] % 4 == 0 else sum(t < 192 for t in ids) / len(ids) for ids in completion_ids]

    grab = Grab()
    args = _args(tmp_path / f"{loss_type}{accumulation}", max_steps=1, loss_type=loss_type,
                 per_device_train_batch_size=2 * G // accumulation, gradient_accumulation_steps=accumulation)
    trainer = GRPOTrainer(_model(path), some_unscored, processing_class=tok, train_dataset=prompts[:2],
                          callbacks=[grab], args=args)
    trainer.train()
    return grab.grads, [trainer._buffer[s]["loss_mask"].sum().item() for s in sorted(trainer._buffer)]


def test_dapo_divides_by_the_whole_generation_batch(setup, tmp_path):
    """dapo: Σ token losses / loss tokens of the whole step. Two accumulated micro-batches of unequal token counts
    give the gradient of the one-batch step (= bnpo on one batch); bnpo accumulated (a mean per micro-batch,
    then over micro-batches) does not. Before, the trainer never passed the step's count, so dapo was bnpo."""
    path, tok, prompts, _ = setup
    dapo2, tokens = _first_step(path, tok, prompts, tmp_path, loss_type="dapo", accumulation=2)
    dapo1, _ = _first_step(path, tok, prompts, tmp_path, loss_type="dapo", accumulation=1)
    bnpo2, _ = _first_step(path, tok, prompts, tmp_path, loss_type="bnpo", accumulation=2)
    bnpo1, _ = _first_step(path, tok, prompts, tmp_path, loss_type="bnpo", accumulation=1)
    assert len(tokens) == 2 and tokens[0] != tokens[1], tokens  # the case that tells them apart

    def close(a, b):
        scale = max(g.abs().max().item() for g in b.values())
        assert scale > 0
        return all(torch.allclose(a[n], g, atol=1e-5 * scale, rtol=1e-4) for n, g in b.items())

    assert close(dapo2, dapo1) and close(bnpo1, dapo1)
    assert not close(bnpo2, dapo2)


def test_pad_to_multiple_of_pads_the_rollout_and_leaves_the_loss_unchanged(setup, tmp_path):
    """TRL's pad_to_multiple_of: prompt and completion widths rounded up to a multiple of 16 (prompt left-padded,
    completion right-padded, both masked); the same samples (seeded) give the same loss as unpadded rows."""
    path, tok, prompts, _ = setup
    model = _model(path)
    batches = {}
    for multiple in (None, 16):
        trainer = GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                              args=_args(tmp_path, pad_to_multiple_of=multiple, max_completion_length=5))
        batch = trainer.make_batch(prompts[:2])
        batches[multiple] = (batch, trainer.compute_loss(model, batch).detach())
    (plain, loss), (padded, padded_loss) = batches[None], batches[16]
    width, total = padded["completion_mask"].shape[1], padded["input_ids"].shape[1]
    assert (width, total % 16) == (16, 0) and plain["completion_mask"].shape[1] == 5
    prompt_plain = plain["input_ids"].shape[1] - 5
    assert total - width == -(-prompt_plain // 16) * 16 > prompt_plain
    assert padded["attention_mask"].sum() == plain["attention_mask"].sum()  # the new columns are masked out
    assert torch.equal(padded["completion_mask"][:, :5], plain["completion_mask"])
    assert not padded["completion_mask"][:, 5:].any() and not padded["loss_mask"][:, 5:].any()
    torch.testing.assert_close(padded["advantages"], plain["advantages"])
    torch.testing.assert_close(padded_loss, loss, atol=1e-6, rtol=1e-5)
