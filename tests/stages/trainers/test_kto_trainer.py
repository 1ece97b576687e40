"""KTOTrainer on the built-in model and unpaired rows: the loss falls, weights move, the data is checked."""
import pytest
import torch

from stages.trainers.kto_trainer import KTOCollator, KTOConfig, KTOTrainer, check_labels, tokenize_unpaired
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    rows = builtin_rows("unpaired", "unpaired", num_preference=256)
    return path, AutoTokenizer.from_pretrained(path), rows


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=16, learning_rate=5e-3,
                logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    return KTOConfig(**{**base, **kw})


def test_loss_falls_and_every_parameter_changes(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    model = AutoModelForCausalLM.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = KTOTrainer(model, args=_args(tmp_path), processing_class=tok, train_dataset=rows,
                         eval_dataset=rows[:32])
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < 0.49  # 0.5 before training
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # r = z = 0 at step 1: 1 - σ(0)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-4)
    assert sum(h["loss"] for h in logs[-5:]) < 0.9 * sum(h["loss"] for h in logs[:5])
    last = logs[-5:]
    assert sum(h["rewards/chosen"] - h["rewards/rejected"] for h in last) > 0
    assert all(k in logs[-1] for k in ("logps/chosen", "logps/rejected", "kl"))
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    ref = dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in before)  # the reference stayed frozen


def test_kl_rows_pair_each_prompt_with_the_next_completion(setup):
    _, tok, rows = setup
    feats = tokenize_unpaired(tok, rows[:3], 256)
    batch = KTOCollator(tok.pad_token_id, 256)(feats)
    for i in range(3):
        j = (i + 1) % 3
        expect = feats[i]["prompt_ids"] + feats[j]["completion_ids"]
        n = len(expect)
        assert batch["kl_input_ids"][i, :n].tolist() == expect
        assert batch["kl_completion_mask"][i, :n].sum() == len(feats[j]["completion_ids"])
        assert batch["input_ids"][i, :len(feats[i]["prompt_ids"])].tolist() == feats[i]["prompt_ids"]
    assert batch["desirable"].tolist() == [r["label"] for r in rows[:3]]


def test_single_class_is_an_error(setup, tmp_path):
    path, tok, rows = setup
    desirable = [r for r in rows if r["label"]]
    with pytest.raises(ValueError, match=r"only desirable rows \(\d+\): KTO needs both"):
        KTOTrainer(None, args=_args(tmp_path), processing_class=tok, train_dataset=desirable)
    with pytest.raises(ValueError, match="row 0: label = 'yes'"):
        tokenize_unpaired(tok, [{**rows[0], "label": "yes"}], 256)
    assert _args(tmp_path, per_device_train_batch_size=1).per_device_train_batch_size == 1  # KL pairs are per row


def test_class_balance_warning_recommends_weights():
    with pytest.warns(UserWarning, match=r"= 3, outside \[1, 4/3\].*undesirable_weight in \[2.25, 3\].*"
                                         r"desirable_weight in \[0.333, 0.444\]"):
        check_labels([True] * 30 + [False] * 10, 1.0, 1.0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_labels([True] * 30 + [False] * 10, 1.0, 2.5)  # 30 / 25 = 1.2: inside
        check_labels([True] * 10 + [False] * 10, 1.0, 1.0)


def test_one_packed_forward_gives_the_same_loss_and_kl_as_separate_rows(setup, tmp_path):
    """A step of one micro-batch runs matched and mismatched rows as pairs packed on their shared prompt
    (one forward per model); the loss, the KL and the gradients equal those of the separate padded rows."""
    from transformers import AutoModelForCausalLM

    from stages.logprobs import causal_lm
    from stages.pair_packing import pack_pairs
    from stages.trainers.kto_trainer import _pairs

    path, tok, rows = setup
    trainer = KTOTrainer(AutoModelForCausalLM.from_pretrained(path), args=_args(tmp_path), processing_class=tok,
                         train_dataset=rows)
    model = trainer.model.train()
    batch = KTOCollator(tok.pad_token_id, 256)(tokenize_unpaired(tok, rows[:8], 256))
    packed = pack_pairs(causal_lm(model), _pairs(batch))
    assert packed is not None and packed.tokens < 0.9 * _pairs(batch)["input_ids"].numel()  # the prompt once

    def loss_and_grads(inputs):
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), trainer._metrics["train"]["kl"][-1], [p.grad.clone() for p in model.parameters()]

    packed_loss, packed_kl, packed_grads = loss_and_grads(batch)
    kl = trainer.kl_estimate(model, [batch])
    separate_loss, separate_kl, separate_grads = loss_and_grads({**batch, "kl": kl})
    assert packed_kl == pytest.approx(separate_kl, abs=1e-5)
    assert packed_loss.item() == pytest.approx(separate_loss.item(), abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-3) for a, b in zip(packed_grads, separate_grads, strict=True))


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_precomputed_reference_trains_exactly_as_the_live_one(setup, tmp_path):
    """precompute_ref_log_probs: one reference pass before training stores each row's and its KL pair's reference
    log-probs; training then runs no reference forward, keeps no reference model, and logs the same losses and
    KL as with the reference run every step."""
    from transformers import AutoModelForCausalLM

    from stages.trainers import reference_model

    path, tok, rows = setup
    runs = {}
    for precompute in (False, True):
        torch.manual_seed(0)
        trainer = KTOTrainer(AutoModelForCausalLM.from_pretrained(path), processing_class=tok, train_dataset=rows,
                             args=_args(tmp_path, max_steps=6, precompute_ref_log_probs=precompute,
                                        precompute_ref_batch_size=64))
        forwards = reference_model.REFERENCE_FORWARDS
        trainer.train()
        runs[precompute] = trainer, reference_model.REFERENCE_FORWARDS - forwards
    live, precomputed = runs[False][0], runs[True][0]
    assert runs[True][1] == 0 and runs[False][1] > 0
    assert precomputed.ref_model is None
    assert {"ref_logps", "ref_kl_logps"} <= set(precomputed.train_dataset.column_names)
    assert _losses(precomputed) == pytest.approx(_losses(live), abs=1e-5)
    kls = [[h["kl"] for h in t.state.log_history if "kl" in h] for t in (live, precomputed)]
    assert kls[1] == pytest.approx(kls[0], abs=1e-5) and any(abs(k) > 1e-4 for k in kls[0][1:])


def test_precomputed_reference_with_lora_is_the_base_model(setup, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    trainer = KTOTrainer(AutoModelForCausalLM.from_pretrained(path), processing_class=tok, train_dataset=rows[:8],
                         args=_args(tmp_path, max_steps=1, precompute_ref_log_probs=True),
                         peft_config=LoraConfig(r=4, target_modules="all-linear"))
    base = AutoModelForCausalLM.from_pretrained(path)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    from stages.trainers.pair_batches import sequence_logps

    with torch.no_grad():
        expected = sequence_logps(base, {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask")})
    assert batch["ref_logps"] == pytest.approx(expected, abs=1e-5)


def test_apo_zero_unpaired_trains_without_a_kl_estimate(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    trainer = KTOTrainer(AutoModelForCausalLM.from_pretrained(path), processing_class=tok, train_dataset=rows,
                         args=_args(tmp_path, max_steps=10, loss_type="apo_zero_unpaired"))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # r = 0: desirable 1 - σ(0), undesirable σ(0)
    assert logs[-1]["loss"] < logs[0]["loss"] and not any("kl" in h for h in logs)


def test_sync_ref_model_mixes_the_reference_towards_the_policy(setup, tmp_path):
    """TR-DPO: at every ref_model_sync_steps-th step the reference becomes α·policy + (1 - α)·reference; checked
    against the weights saved at the step before the sync (3 steps, a sync after step 2 only)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    path, tok, rows = setup
    trainer = KTOTrainer(AutoModelForCausalLM.from_pretrained(path), processing_class=tok, train_dataset=rows,
                         args=_args(tmp_path, max_steps=3, sync_ref_model=True, ref_model_sync_steps=2,
                                    ref_model_mixup_alpha=0.25))
    seen = {}

    class Snapshot(TrainerCallback):  # runs after SyncReference (added first, by the trainer)
        def on_step_end(self, args, state, control, **kwargs):
            seen[state.global_step] = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}

    start = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    policy_at = {}

    class PolicyAt(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            policy_at[state.global_step + 1] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    trainer.add_callback(PolicyAt())
    trainer.add_callback(Snapshot())
    trainer.train()
    assert all(torch.equal(seen[1][n], start[n]) for n in start)  # step 1: no sync
    for n in start:  # step 2: synced with the policy after its second update
        assert torch.allclose(seen[2][n], 0.25 * policy_at[2][n] + 0.75 * start[n], atol=1e-6), n
    assert all(torch.equal(seen[3][n], seen[2][n]) for n in start)
    with pytest.raises(ValueError, match="sync_ref_model = true with precompute_ref_log_probs = true"):
        _args(tmp_path, sync_ref_model=True, precompute_ref_log_probs=True)


def test_compute_metrics_gets_trls_logits_and_input_ids(setup, tmp_path):
    """As TRL 1.16: predictions are the policy's logits (B, T, V) of each eval batch's rows, label_ids their
    input ids (prompt + completion); equal to a direct forward of each row."""
    from transformers import AutoModelForCausalLM

    path, tok, rows = setup
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"rows": float(len(prediction.label_ids))}

    model = AutoModelForCausalLM.from_pretrained(path)
    args = KTOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_eval_batch_size=2,
                     precompute_ref_log_probs=False)
    trainer = KTOTrainer(model, args=args, processing_class=tok, train_dataset=rows[:8], eval_dataset=rows[:3],
                         compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 3 and "eval_loss" in metrics
    model.eval()
    for k in range(3):
        row = trainer.eval_dataset[k]
        ids = row["prompt_ids"] + row["completion_ids"]
        assert seen["labels"][k, :len(ids)].tolist() == ids
        with torch.no_grad():
            direct = model(torch.tensor([ids])).logits[0]
        assert seen["predictions"][k, :len(ids)] == pytest.approx(direct.numpy(), abs=1e-4)


def test_prediction_step_matches_trls_on_the_same_batch(setup, tmp_path):
    """apo_zero_unpaired needs no KL rows (TRL pairs them differently), so the loss is comparable too."""
    trl = pytest.importorskip("trl")
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    path, tok, _ = setup
    rows = Dataset.from_dict({"prompt": ["What is 2+3?", "What is 4+4?", "What is 1+1?", "What is 3+3?"],
                              "completion": [" 5", " 9 or 10", " 2", " 7"], "label": [True, False, True, False]})
    out = []
    for config_cls, trainer_cls in ((trl.KTOConfig, trl.KTOTrainer), (KTOConfig, KTOTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(AutoModelForCausalLM.from_pretrained(path), processing_class=tok,
                                  args=config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                                                  gradient_checkpointing=False, loss_type="apo_zero_unpaired",
                                                  precompute_ref_log_probs=False),
                                  train_dataset=rows, eval_dataset=rows)
            batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(4)])
            trainer.model.eval()
            out.append(trainer.prediction_step(trainer.model, batch, prediction_loss_only=False))
    (their_loss, their_logits, their_ids), (loss, logits, ids) = out
    assert torch.equal(ids, their_ids) and torch.allclose(logits, their_logits, atol=1e-5)
    assert loss.item() == pytest.approx(their_loss.item(), rel=1e-5)
