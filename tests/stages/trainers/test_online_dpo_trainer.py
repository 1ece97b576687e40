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


def test_evaluation_samples_ranks_and_reports_eval_metrics_and_predictions(tmp_path):
    """eval_dataset: each held-out prompt is sampled twice (a fixed draw) and ranked by the reward; the loss of
    the kept pairs is eval_loss (ln 2 before any update: policy == reference), the scores arrive under eval_, and
    compute_metrics gets the pairs' logits (2B, T, V) and input ids, as DPOTrainer's. Training moves eval_loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    rows = builtin_rows("prompts", "prompt_only", num_preference=10)
    scored: list[float] = []

    def recording_digits(prompts, completions, **columns):
        values = digits(prompts, completions)
        scored.extend(values)
        return values

    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"pair_rows": float(len(prediction.label_ids))}

    model = AutoModelForCausalLM.from_pretrained(path)
    args = OnlineDPOConfig(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=8,
                           per_device_eval_batch_size=4, learning_rate=1e-2, beta=0.5, max_new_tokens=8,
                           logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
                           eval_strategy="steps", eval_steps=2)
    trainer = OnlineDPOTrainer(model, reward_funcs=recording_digits, args=args, processing_class=tok,
                               train_dataset=rows, eval_dataset=rows[:6], compute_metrics=compute_metrics)
    before = trainer.evaluate()
    assert before["eval_loss"] == pytest.approx(0.6931, abs=1e-3)
    assert before["eval_pair_rows"] == 12  # 6 prompts x (chosen, rejected); the last batch of 2 prompts kept whole
    assert before["eval_scores/mean"] == pytest.approx((sum(scored[:8]) / 8 + sum(scored[8:12]) / 4) / 2)
    assert {"eval_win_rate", "eval_pairs/dropped", "eval_scores/chosen"} <= set(before)
    assert trainer.evaluate()["eval_scores/mean"] == before["eval_scores/mean"]  # the fixed draw
    model.eval()
    pairs = trainer.make_pairs(rows[:4], evaluation=True)  # the first eval batch again: the same draw
    ids = pairs["input_ids"]
    assert torch.equal(torch.as_tensor(seen["labels"][:8, :ids.shape[1]]), ids)
    with torch.no_grad():
        direct = model(input_ids=ids, attention_mask=pairs["attention_mask"]).logits
    assert torch.allclose(torch.as_tensor(seen["predictions"][:8, :ids.shape[1]]), direct, atol=1e-4)
    trainer._metrics["eval"].clear()  # make_pairs above recorded its scores as evaluation's
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] != pytest.approx(0.6931, abs=1e-3)
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 4, 4]  # eval_steps, then ours
    assert [h for h in trainer.state.log_history if "eval_loss" in h][-1]["eval_loss"] == after["eval_loss"]
    train_lines = [h for h in trainer.state.log_history if "loss" in h]
    assert train_lines and all("scores/mean" in h and not any(k.startswith("eval_") for k in h)
                               for h in train_lines)


def test_eval_rows_need_prompts(tmp_path):
    path = build_tiny(tmp_path / "tiny")
    args = OnlineDPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    rows = builtin_rows("prompts", "prompt_only", num_preference=4)
    with pytest.raises(ValueError, match=r"eval_dataset\['held'\]: online DPO needs rows with a 'prompt' column; "
                                         r"1 of 2 rows lack it \(first: row 1\)"):
        OnlineDPOTrainer(str(path), reward_funcs=digits, args=args, train_dataset=rows,
                         eval_dataset={"held": [rows[0], {"question": "1+1"}]})
