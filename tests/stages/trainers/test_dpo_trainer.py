"""DPOTrainer on the built-in model and preference pairs: the loss falls, weights move, the pieces agree."""
import pytest
import torch

from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
from stages.trainers.pair_batches import PairCollator, sequence_logps, tokenize_pairs
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4,
                      intermediate_size=128)
    rows = builtin_rows("preference", "preference", num_preference=256)
    return path, AutoTokenizer.from_pretrained(path), rows


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=15, per_device_train_batch_size=16, learning_rate=2e-3,
                logging_steps=5, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                precompute_ref_log_probs=False)  # the live reference; test_dpo_extensions covers precomputing
    return DPOConfig(**{**base, **kw})


def test_loss_falls_and_every_parameter_changes(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    model = AutoModelForCausalLM.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPOTrainer(model, args=_args(tmp_path, logging_steps=1), processing_class=tok, train_dataset=rows)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 1: -log sigmoid(0)
    assert sum(h["loss"] for h in logs[-5:]) < sum(h["loss"] for h in logs[:5])
    assert sum(h["rewards/accuracies"] for h in logs[-5:]) / 5 > 0.7 and logs[-1]["rewards/margins"] > 0
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    ref = dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in before)  # the reference stayed frozen


def test_chunked_and_logits_logps_agree(setup):
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    model = AutoModelForCausalLM.from_pretrained(path)
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, rows[:4], 256))
    assert batch["input_ids"].shape[0] == 8
    fast, slow = (sequence_logps(model, batch, chunked=c) for c in (True, False))
    assert torch.allclose(fast, slow, atol=1e-4)
    avg = sequence_logps(model, batch, average=True)
    assert torch.allclose(avg * batch["completion_mask"][:, 1:].sum(-1), fast, atol=1e-4)


def test_lora_reference_is_the_adapter_disabled_base(setup, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer = DPOTrainer(model, args=_args(tmp_path, max_steps=3), processing_class=tok, train_dataset=rows)
    assert trainer.ref_model is None  # no second copy of the weights
    trainer.train()
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, rows[:2], 256))
    ref_c, _ = trainer.reference_logps(model, batch)
    base = AutoModelForCausalLM.from_pretrained(path)
    assert torch.allclose(ref_c, sequence_logps(base, batch).chunk(2)[0], atol=1e-4)


def test_bad_preference_input(setup, tmp_path):
    path, tok, rows = setup
    same = [{**rows[0], "rejected": rows[0]["chosen"]}]
    with pytest.raises(ValueError, match="identical chosen and rejected"):
        tokenize_pairs(tok, same, 256)
    with pytest.raises(ValueError, match="the prompt fills max_length = 4"):
        tokenize_pairs(tok, rows[:1], 4)
    with pytest.raises(ValueError, match=r"beta = 0.0: must be > 0"):
        _args(tmp_path, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing = 0.5"):
        _args(tmp_path, label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type = 'nope': supported: sigmoid"):
        _args(tmp_path, loss_type="nope")


def test_compute_metrics_gets_trls_logits_and_input_ids(setup, tmp_path):
    """As TRL 1.16: predictions are the policy's logits (2B, T, V) of each eval batch's chosen then rejected rows,
    label_ids their input ids; 3 pairs in batches of 2 keep every row, and the logits are a direct forward's."""
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"rows": float(len(prediction.label_ids))}

    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = DPOTrainer(model, args=_args(tmp_path, per_device_eval_batch_size=2), processing_class=tok,
                         train_dataset=rows[:4], eval_dataset=rows[:3], compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 6 and "eval_loss" in metrics and "eval_rewards/accuracies" in metrics
    order = [0, 1, 0, 1, 2, 2]  # batch 1: chosen 0, 1, rejected 0, 1; batch 2: chosen 2, rejected 2
    sides = ["chosen", "chosen", "rejected", "rejected", "chosen", "rejected"]
    model.eval()
    for k, (i, side) in enumerate(zip(order, sides, strict=True)):
        ids = trainer.eval_dataset[i][f"{side}_input_ids"]
        assert seen["labels"][k, :len(ids)].tolist() == ids
        assert set(seen["labels"][k, len(ids):].tolist()) <= {tok.pad_token_id, -100}  # padding: in / across batches
        with torch.no_grad():
            direct = model(torch.tensor([ids])).logits[0]
        assert seen["predictions"][k, :len(ids)] == pytest.approx(direct.numpy(), abs=1e-4)


def test_prediction_step_matches_trls_on_the_same_batch(setup, tmp_path):
    trl = pytest.importorskip("trl")
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    pairs = Dataset.from_dict({"prompt": ["What is 2+3?", "What is 4+4?"], "chosen": [" 5", " 8"],
                               "rejected": [" 6", " 9 or 10"]})
    out = []
    for config_cls, trainer_cls in ((trl.DPOConfig, trl.DPOTrainer), (DPOConfig, DPOTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(AutoModelForCausalLM.from_pretrained(path), processing_class=tok,
                                  args=config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                                                  gradient_checkpointing=False, precompute_ref_log_probs=False),
                                  train_dataset=pairs, eval_dataset=pairs)
            batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(2)])
            trainer.model.eval()
            out.append(trainer.prediction_step(trainer.model, batch, prediction_loss_only=False))
    (their_loss, their_logits, their_ids), (loss, logits, ids) = out
    assert torch.equal(ids, their_ids) and torch.allclose(logits, their_logits, atol=1e-5)
    assert loss.item() == pytest.approx(their_loss.item(), rel=1e-5)


def test_padding_free_gives_the_padded_loss_from_one_row_per_batch(setup, tmp_path):
    """TRL's padding_free: each batch's policy and reference forwards run as one row without padding (the pairs
    packed on their prefixes and joined); the loss is the padded one. It refuses pad_to_multiple_of beside it."""
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    losses, widths = [], []
    for free in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path)
        model.register_forward_pre_hook(lambda m, a, kw: widths.append(tuple(kw["input_ids"].shape)),
                                        with_kwargs=True)
        trainer = DPOTrainer(model, args=_args(tmp_path, padding_free=free, per_device_train_batch_size=4),
                             processing_class=tok, train_dataset=rows[:8])
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        widths.clear()
        losses.append(trainer.compute_loss(model, batch).detach())
    # policy, then live reference: each model's first-use check (2 pairs padded, then packed), then one row
    assert [w[0] for w in widths] == [4, 2, 1] * 2 and widths[2] == widths[5]
    assert widths[2][1] < batch["attention_mask"].sum()  # fewer than the padded rows' real tokens: prompts once
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"padding_free.*= True with pad_to_multiple_of = 8"):
        _args(tmp_path, padding_free=True, pad_to_multiple_of=8)
