"""OnlineDPOTrainer: sample two completions per prompt, rank them by a reward, DPO on the fresh pairs."""
import pytest
import torch

from stages.trainers.online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer, pair_features, rank_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def digits(prompts, completions, **columns):
    """A dense toy reward: the share of digit characters in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def test_rank_pairs_and_features():
    # pairs (0,1): 1 > 0, chosen 0; (2,3): None, dropped; (4,5): tie, dropped; (6,7): 2 < 5, chosen 7
    assert rank_pairs([1.0, 0.0, None, 2.0, 3.0, 3.0, 2.0, 5.0]) == ([(0, 1), (7, 6)], 2)
    f = pair_features([5, 6, 7], [8, 9], [10], max_length=4)
    assert f == {"chosen_input_ids": [5, 6, 7, 8], "chosen_completion_mask": [0, 0, 0, 1],
                 "rejected_input_ids": [5, 6, 7, 10], "rejected_completion_mask": [0, 0, 0, 1], "weight": 1.0}
    assert pair_features([5, 6, 7], [8, 9], [8, 9], max_length=4, weight=0.0)["weight"] == 0.0  # a dropped tie
    with pytest.raises(ValueError, match="a prompt of 3 tokens fills max_length = 3"):
        pair_features([5, 6, 7], [8], [9], max_length=3)


def test_online_dpo_trains(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    rows = builtin_rows("prompts", "prompt_only", num_preference=10)
    model = AutoModelForCausalLM.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = OnlineDPOConfig(output_dir=str(tmp_path / "out"), max_steps=30, per_device_train_batch_size=16,
                           learning_rate=1e-2, beta=0.5, max_new_tokens=8,
                           logging_steps=1, report_to="none",
                           use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = OnlineDPOTrainer(model, reward_funcs=digits, args=args, processing_class=tok, train_dataset=rows)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at the first step
    assert sum(h["loss"] for h in logs[-5:]) < sum(h["loss"] for h in logs[:5])
    # What online training is for: the policy's own samples score higher (measured ~0.03 -> ~0.13).
    assert sum(h["scores/mean"] for h in logs[-5:]) > 2 * sum(h["scores/mean"] for h in logs[:5])
    assert sum(h["pairs/dropped"] for h in logs) > 0  # ties happen (e.g. two digit-free samples) and are counted
    assert all(h["scores/chosen"] > h["scores/rejected"] for h in logs if "scores/chosen" in h)
    assert "win_rate" in logs[-1] and "pairs/dropped" in logs[-1]
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    ref = dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in before)


def test_penalise_missing_eos_and_beta_for_epoch():
    from stages.trainers.method_fields import beta_for_epoch
    from stages.trainers.online_dpo_trainer import penalise_missing_eos

    assert penalise_missing_eos([1.0, 2.0, None, 0.5], [True, False, False, False], 0.25) == [1.0, 1.75, None, 0.25]
    assert penalise_missing_eos([1.0, 2.0], [True, False], None) == [1.0, 2.0]
    assert [beta_for_epoch([0.5, 0.2], e) for e in (0.0, 0.99, 1.0, 1.5, 7.0)] == [0.5, 0.5, 0.2, 0.2, 0.2]
    assert beta_for_epoch(0.3, 4.0) == 0.3


def _online(tmp_path, reward, rows, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "tiny")
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-3,
                max_new_tokens=4, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0)
    return OnlineDPOTrainer(AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward,
                            args=OnlineDPOConfig(**{**base, **kw}),
                            processing_class=AutoTokenizer.from_pretrained(path), train_dataset=rows)


def test_beta_list_sets_beta_per_epoch(tmp_path):
    rows = builtin_rows("prompts", "prompt_only", num_preference=8)
    def token_sum(prompts, completions, completion_ids, **columns):  # two samples rarely tie on it
        return [float(sum(ids)) for ids in completion_ids]

    trainer = _online(tmp_path, token_sum, rows, num_train_epochs=3, beta=[0.5, 0.2])
    trainer.train()
    betas = [h["beta"] for h in trainer.state.log_history if "beta" in h]
    assert betas == pytest.approx([0.5, 0.5, 0.2, 0.2, 0.2, 0.2])  # 2 steps an epoch; the last for the rest


def test_missing_eos_penalty_lowers_the_score_of_cut_completions(tmp_path):
    """A reward of 1 for every completion: every pair ties, unless the penalty tells cut completions (no EOS
    within max_new_tokens) from finished ones; the logged mean score is 1 - penalty x (share cut)."""
    seen = []

    def one(prompts, completions, completion_ids, **columns):
        seen.extend(completion_ids)
        return [1.0] * len(completions)

    rows = builtin_rows("prompts", "prompt_only", num_preference=8)
    trainer = _online(tmp_path, one, rows, max_steps=1, missing_eos_penalty=0.5, max_new_tokens=2)
    trainer.train()
    eos = trainer.processing_class.eos_token_id
    cut = sum(eos not in ids for ids in seen) / len(seen)
    assert 0 < cut
    [log] = [h for h in trainer.state.log_history if "scores/mean" in h]
    assert log["scores/mean"] == pytest.approx(1 - 0.5 * cut)


def test_reward_model_path_ranks_when_reward_funcs_is_not_given(tmp_path):
    rows = builtin_rows("prompts", "prompt_only", num_preference=4)
    with pytest.raises(ValueError, match="reward_funcs is None.*or set args.reward_model_path"):
        _online(tmp_path, None, rows, max_steps=1)
    with pytest.raises(ValueError, match="both reward_funcs and args.reward_model_path"):
        _online(tmp_path, digits, rows, max_steps=1, reward_model_path=str(tmp_path))


def test_trls_sampling_fields_reach_the_sampler():
    from stages.generation import SamplingParams

    args = OnlineDPOConfig(output_dir="unused", min_p=0.1, repetition_penalty=1.2, report_to="none",
                           generation_kwargs={"no_repeat_ngram_size": 2}, cache_implementation="static")
    g = args.sampling  # the record the backend takes, with the pair each prompt gets
    assert isinstance(g, SamplingParams) and (g.n, g.do_sample) == (2, True)
    assert (g.min_p, g.repetition_penalty, g.generation_kwargs, g.cache_implementation) == (
        0.1, 1.2, {"no_repeat_ngram_size": 2}, "static")
    with pytest.raises(ValueError, match=r"min_p = 1.5: must be in \[0, 1\) or null"):
        OnlineDPOConfig(output_dir="unused", min_p=1.5, report_to="none")
