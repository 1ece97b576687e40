"""RewardTrainer on the built-in model and preference pairs: the loss falls, weights move, margins and centring
enter the loss, LoRA trains the adapter and the head, and evaluation / scoring agree with training."""
import pytest
import torch

from stages.harness.config import VERIFIED_FIRST, VERIFIED_FIRST_WEIGHTS, LoraParams, ScoreParams
from stages.losses import reward_loss
from stages.reward_functions import build_reward_functions, load_reward_function, sigmoid
from stages.reward_model import evaluate_reward_model, load_reward_model, score_texts, sequence_rewards
from stages.trainers.adapters import apply_lora
from stages.trainers.reward_trainer import RewardCollator, RewardConfig, RewardTrainer, tokenize_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4,
                      intermediate_size=128)
    rows = builtin_rows("preference", "preference", num_preference=256)
    return str(path), AutoTokenizer.from_pretrained(path), rows


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=16, learning_rate=2e-3,
                logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    return RewardConfig(**{**base, **kw})


def _model(path, tok):
    torch.manual_seed(0)  # the new score head is drawn from torch's generator
    return load_reward_model(path, tok)


def _first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


def test_loss_falls_accuracy_rises_and_every_parameter_changes(setup, tmp_path):
    path, tok, rows = setup
    model = _model(path, tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RewardTrainer(model, args=_args(tmp_path), processing_class=tok, train_dataset=rows)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    first, last = logs[:5], logs[-5:]
    assert sum(h["loss"] for h in last) < sum(h["loss"] for h in first) - 0.5  # mean falls by > 0.1
    assert sum(h["accuracy"] for h in last) > sum(h["accuracy"] for h in first)
    assert sum(h["accuracy"] for h in last) / 5 > 0.7 and last[-1]["margin"] > 0
    assert all(h["reward_min"] <= h["reward_mean"] <= h["reward_max"] for h in logs)
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]


def test_margin_column_and_centering_enter_the_loss(setup, tmp_path):
    """On one batch, compute_loss equals reward_loss of the batch's rewards with the rows' margins and
    the centering coefficient; a margin of 2 per pair raises the loss at the same rewards."""
    path, tok, rows = setup
    model = _model(path, tok)
    with_margin = [{**r, "margin": 2.0} for r in rows[:32]]
    trainer = RewardTrainer(model, args=_args(tmp_path, center_rewards_coefficient=0.5), processing_class=tok,
                            train_dataset=with_margin)
    batch = _first_batch(trainer)
    assert torch.equal(batch["margin"], torch.full((16,), 2.0))
    loss = trainer.compute_loss(model, batch)
    chosen, rejected = sequence_rewards(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
    plain = reward_loss(chosen, rejected)[0]
    margin_only = reward_loss(chosen, rejected, margin=batch["margin"])[0]
    assert loss.item() == pytest.approx(margin_only.item() + 0.5 * ((chosen + rejected) ** 2).mean().item(), abs=1e-5)
    assert margin_only > plain
    trainer.train()  # the margin column survives the dataset and collator through training
    assert trainer.state.global_step == 20


def test_bad_margins(setup):
    path, tok, rows = setup
    with pytest.raises(ValueError, match="preference row 1 has no margin but row 0 has one"):
        tokenize_pairs(tok, [{**rows[0], "margin": 1.0}, rows[1]], 256)
    with pytest.raises(ValueError, match=r"preference row 0: margin = 'big': must be a finite number"):
        tokenize_pairs(tok, [{**rows[0], "margin": "big"}], 256)


def test_lora_trains_only_the_adapter_and_the_score_head_and_reloads(setup, tmp_path):
    path, tok, rows = setup
    lora = LoraParams(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = apply_lora(_model(path, tok), lora, task_type="SEQ_CLS")
    assert lora.modules_to_save == []  # PEFT did not extend the params' list in place
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "score.modules_to_save" in n for n in trainable)
    assert any("score.modules_to_save" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RewardTrainer(model, args=_args(tmp_path, max_steps=5), processing_class=tok, train_dataset=rows)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)

    trainer.save_model(str(tmp_path / "adapter"))  # adapter + score head; loads back merged onto its base
    batch = RewardCollator(tok.pad_token_id)(tokenize_pairs(tok, rows[:4], 256))
    with torch.no_grad():
        expected = sequence_rewards(model.eval(), batch["input_ids"], batch["attention_mask"])
        merged = load_reward_model(str(tmp_path / "adapter"), tok).eval()
        assert torch.allclose(sequence_rewards(merged, batch["input_ids"], batch["attention_mask"]), expected,
                              atol=1e-5)


def test_identical_chosen_and_rejected_fail_before_training(setup, tmp_path):
    path, tok, rows = setup
    bad = rows[:5] + [{**rows[5], "rejected": rows[5]["chosen"]}]
    with pytest.raises(ValueError, match=r"preference row 5 has identical chosen and rejected"):
        RewardTrainer(_model(path, tok), args=_args(tmp_path), processing_class=tok, train_dataset=bad)
    with pytest.raises(ValueError, match=r"preference row 0: the prompt fills max_length = 4"):
        tokenize_pairs(tok, rows[:1], 4)
    with pytest.raises(ValueError, match=r"center_rewards_coefficient = -1: must be >= 0"):
        _args(tmp_path, center_rewards_coefficient=-1)
    with pytest.raises(ValueError, match=r"max_length = 0: must be > 0"):
        _args(tmp_path, max_length=0)


def test_evaluation_and_scoring_agree_with_training(setup, tmp_path):
    """score_texts renders like training (same rewards as the training batch); the calibration table's
    counts sum to n and its per-bin accuracies average back to the overall accuracy; ECE recomputes;
    Trainer.evaluate reports the same accuracy and margin."""
    path, tok, rows = setup
    model = _model(path, tok)
    pairs = rows[200:]
    trainer = RewardTrainer(model, args=_args(tmp_path, max_steps=5, per_device_eval_batch_size=64),
                            processing_class=tok, train_dataset=rows[:200], eval_dataset=pairs)
    trainer.train()
    metrics = trainer.evaluate()
    batch = RewardCollator(tok.pad_token_id)(tokenize_pairs(tok, pairs[:8], 1024))
    with torch.no_grad():
        trained_view = sequence_rewards(model.eval(), batch["input_ids"], batch["attention_mask"])[:8]
    as_strings = [r["chosen"][0]["content"] for r in pairs[:8]]  # chat prompt + plain string completion
    scored = score_texts(model, tok, [r["prompt"] for r in pairs[:8]], as_strings, batch_size=3)
    assert torch.allclose(torch.tensor(scored), trained_view, atol=1e-5)

    result = evaluate_reward_model(model, tok, pairs, batch_size=16, max_length=256, bins=4)
    table = result["calibration"]
    assert result["pairs"] == len(pairs) == sum(b["count"] for b in table)
    assert [(b["lower"], b["upper"]) for b in table] == [(0.5, 0.625), (0.625, 0.75), (0.75, 0.875), (0.875, 1.0)]
    full = [b for b in table if b["count"]]
    assert sum(b["count"] * b["accuracy"] for b in full) / len(pairs) == pytest.approx(result["accuracy"])
    assert result["ece"] == pytest.approx(
        sum(b["count"] / len(pairs) * abs(b["accuracy"] - b["mean_confidence"]) for b in full))
    assert all(b["lower"] <= b["mean_confidence"] <= b["upper"] for b in full)
    assert metrics["eval_accuracy"] == pytest.approx(result["accuracy"])  # the Trainer's eval: one batch of all
    assert metrics["eval_margin"] == pytest.approx(result["mean_margin"], abs=1e-4)


def test_saved_model_scores_as_the_reward_model_reward_function(setup, tmp_path):
    """Saved and reloaded through load_reward_function("reward_model"): the same rewards; with a
    `reasoning` column the <think> block is put back before scoring."""
    path, tok, rows = setup
    model = _model(path, tok)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    fn = load_reward_function("reward_model", reward_model_path=str(tmp_path / "rm"))
    prompts = [r["prompt"] for r in rows[:3]]
    full = [r["chosen"][0]["content"] for r in rows[:3]]  # "<think>...</think>130"
    reasoning = [t[len("<think>"):t.index("</think>")] for t in full]
    answers = [t[t.index("</think>") + len("</think>"):] for t in full]
    expected = score_texts(model, tok, prompts, full)
    assert fn(prompts, answers, reasoning=reasoning) == pytest.approx(expected, abs=1e-5)
    assert fn(prompts, answers) != pytest.approx(expected, abs=1e-5)


def test_reward_model_prob_is_the_squashed_score_and_keeps_the_verified_reward_first(setup, tmp_path):
    """reward_model_prob = σ(reward_model), in (0, 1) and in the same order; with VERIFIED_FIRST's weights every
    right answer outscores every wrong one and every wrong one stays under score.min_score, even when the reward
    model's scale is large (here its head scaled x1000; raw r at the old weight 0.05 would let r decide)."""
    path, tok, rows = setup
    model = _model(path, tok)
    with torch.no_grad():
        model.score.weight.mul_(1000.0)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = str(tmp_path / "rm")
    prompts = [r["prompt"] for r in rows[:4]] * 2
    right = [r["chosen"][0]["content"] for r in rows[:4]]
    completions = right + [c[:-1] + str((int(c[-1]) + 1) % 10) for c in right]  # last digit off by one: wrong
    raw = load_reward_function("reward_model", reward_model_path=rm)(prompts, completions)
    prob = load_reward_function("reward_model_prob", reward_model_path=rm)(prompts, completions)
    assert max(abs(r) for r in raw) > 20  # a scale at which raw x 0.05 outweighs exact_match
    assert prob == pytest.approx([sigmoid(r) for r in raw]) and all(0 <= q <= 1 for q in prob)
    answers = [str(int(c[c.index("</think>") + len("</think>"):])) for c in right] * 2
    verified = build_reward_functions(list(VERIFIED_FIRST), list(VERIFIED_FIRST_WEIGHTS), reward_model_path=rm)
    totals, scores = verified(prompts, completions, answer=answers)
    assert scores["exact_match"] == [1.0] * 4 + [0.0] * 4
    assert min(totals[:4]) >= 1.0 > ScoreParams().min_score > max(totals[4:])
    assert sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0  # no overflow


def test_compute_metrics_gets_trls_predictions_the_rewards_of_a_direct_forward(setup, tmp_path):
    """As TRL 1.16: predictions are each eval batch's rewards (2B, 1), chosen rows then rejected; label_ids is
    empty. 5 pairs in batches of 2: the last batch's single pair keeps both rows (accelerate would trim a plain
    gather to 1 row); preprocess_logits_for_metrics sees each batch and what it returns is what arrives."""
    path, tok, rows = setup
    seen: dict = {"batches": []}

    def preprocess(logits, labels):
        seen["batches"].append((tuple(logits.shape), labels))
        return logits * 2

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"mean_prediction": float(prediction.predictions.mean())}

    model = _model(path, tok)
    trainer = RewardTrainer(model, args=_args(tmp_path, per_device_eval_batch_size=2), processing_class=tok,
                            train_dataset=rows[:8], eval_dataset=rows[:5], compute_metrics=compute_metrics,
                            preprocess_logits_for_metrics=preprocess)
    metrics = trainer.evaluate()
    assert seen["batches"] == [((4, 1), ()), ((4, 1), ()), ((2, 1), ())] and seen["labels"] == ()
    expected = []
    model.eval()
    with torch.no_grad():
        for start in (0, 2, 4):
            batch = trainer._prepare_inputs(trainer.data_collator([trainer.eval_dataset[i]
                                                                   for i in range(start, min(start + 2, 5))]))
            expected.append(sequence_rewards(model, batch["input_ids"], batch["attention_mask"], pairs=True))
    expected = 2 * torch.cat(expected).reshape(-1, 1).numpy()
    assert seen["predictions"].shape == (10, 1)
    assert seen["predictions"] == pytest.approx(expected, abs=1e-5)
    assert metrics["eval_mean_prediction"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert "eval_loss" in metrics and "eval_accuracy" in metrics


def test_compute_metrics_receives_what_trls_does(setup, tmp_path):
    """The same reward model and pairs through TRL 1.16's RewardTrainer and ours: the same EvalPrediction
    (rewards (2B, 1), chosen then rejected; label_ids empty) and eval_loss."""
    trl = pytest.importorskip("trl")
    import warnings

    from datasets import Dataset

    path, tok, _ = setup
    pairs = Dataset.from_dict({"prompt": ["What is 2+3?", "What is 4+4?"], "chosen": [" 5", " 8"],
                               "rejected": [" 6", " 9 or 10"]})
    out = []
    for config_cls, trainer_cls in ((trl.RewardConfig, trl.RewardTrainer), (RewardConfig, RewardTrainer)):
        seen: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(_model(path, tok), processing_class=tok, train_dataset=pairs, eval_dataset=pairs,
                                  args=config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                                                  gradient_checkpointing=False, per_device_eval_batch_size=2),
                                  compute_metrics=lambda e, s=seen: s.update(p=e.predictions, l=e.label_ids) or {})
            seen["loss"] = trainer.evaluate()["eval_loss"]
        out.append(seen)
    theirs, ours = out
    assert ours["p"].shape == theirs["p"].shape == (4, 1) and ours["l"] == theirs["l"] == ()
    assert ours["p"] == pytest.approx(theirs["p"], abs=1e-6) and ours["loss"] == pytest.approx(theirs["loss"])
