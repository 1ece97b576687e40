"""DPO extensions: precomputed reference log-probs, objective combinations, pair/task weights, balanced batches."""
from collections import Counter

import pytest
import torch

from stages.losses import dpo_loss
from stages.trainers import reference_model as reference
from stages.trainers.balanced_sampler import BalancedBatchSampler
from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
from stages.trainers.pair_batches import REF_COLUMNS, completion_token_counts, sequence_logps
from stages.trainers.reference_model import compute_reference_logps, reference_logps_table
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    rows = builtin_rows("preference", "preference")
    return path, AutoTokenizer.from_pretrained(path), rows


NOISE = 0.3  # big enough that policy and reference log-probs differ by several nats


def _load(path, noise=0.0):
    """The tiny model; with noise, perturbed so that policy and reference differ (losses away from log 2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return model


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0, precompute_ref_log_probs=False)
    return DPOConfig(**{**base, **kw})


def _batch_loss(trainer, rows_slice=slice(0, 8)):
    batch = trainer.data_collator(trainer.train_dataset.select(range(rows_slice.start, rows_slice.stop)).to_list())
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item(), batch


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_precomputed_reference_matches_live(setup, tmp_path, loss_type):
    path, tok, rows = setup
    ref = _load(path)
    live = DPOTrainer(_load(path, NOISE), ref, args=_args(tmp_path, loss_type=loss_type), processing_class=tok,
                      train_dataset=rows)
    pre = DPOTrainer(_load(path, NOISE), ref, args=_args(tmp_path, loss_type=loss_type, precompute_ref_log_probs=True),
                     processing_class=tok, train_dataset=rows)
    assert pre.ref_model is None and set(REF_COLUMNS) <= set(pre.train_dataset.column_names)
    loss_live, batch = _batch_loss(live)
    loss_pre, _ = _batch_loss(pre)
    assert abs(loss_live - (0.6931 if loss_type == "sigmoid" else 25.0)) > 0.01  # not the step-0 value: a real test
    assert loss_pre == pytest.approx(loss_live, abs=1e-5)
    # Summed columns, computed once, serve IPO too (it divides by the batch's own token counts).
    with_ref = compute_reference_logps(ref, tok, rows, max_length=1024, batch_size=5)
    assert [{k: v for k, v in r.items() if k not in REF_COLUMNS} for r in with_ref] == rows
    given = DPOTrainer(_load(path, NOISE), args=_args(tmp_path, loss_type=loss_type), processing_class=tok,
                       train_dataset=with_ref)
    assert given.ref_model is None  # the columns make a reference model unnecessary
    assert _batch_loss(given)[0] == pytest.approx(loss_live, abs=1e-5)
    sums = torch.tensor([[r[c] for c in REF_COLUMNS] for r in with_ref])
    avg = reference_logps_table(ref, tok, rows[:8], max_length=1024, average=True)
    counts = torch.stack(completion_token_counts(batch).chunk(2), dim=1)
    assert torch.allclose(avg * counts, sums[:8], atol=1e-4)


def test_precompute_runs_no_reference_forward_during_training(setup, tmp_path):
    path, tok, rows = setup
    before = reference.REFERENCE_FORWARDS
    trainer = DPOTrainer(_load(path), args=_args(tmp_path, precompute_ref_log_probs=True), processing_class=tok,
                         train_dataset=rows, eval_dataset=rows[:16])
    # one precompute pass, in TRL's batch sizes: 64 train rows / train batch 8 + 16 eval rows / eval batch 16
    assert reference.REFERENCE_FORWARDS - before == 9
    start = reference.REFERENCE_FORWARDS
    assert trainer.evaluate()["eval_loss"] == pytest.approx(0.6931, abs=1e-4)  # policy == reference
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < 0.6931
    assert reference.REFERENCE_FORWARDS == start and trainer.ref_model is None
    live = DPOTrainer(_load(path), args=_args(tmp_path), processing_class=tok, train_dataset=rows)
    live.train()
    assert reference.REFERENCE_FORWARDS - start == 3  # the counter does see live reference passes


def test_precompute_ref_batch_size_sets_the_reference_pass_batch(setup, tmp_path):
    path, tok, rows = setup
    before = reference.REFERENCE_FORWARDS
    DPOTrainer(_load(path), args=_args(tmp_path, precompute_ref_log_probs=True, precompute_ref_batch_size=32),
               processing_class=tok, train_dataset=rows, eval_dataset=rows[:16])
    assert reference.REFERENCE_FORWARDS - before == 3  # 64 / 32 + 16 / 32 (one short batch)


def test_combination_is_the_weighted_sum_of_its_parts(setup, tmp_path):
    path, tok, rows = setup
    ref = _load(path)

    def loss(**kw):
        t = DPOTrainer(_load(path, NOISE), ref, args=_args(tmp_path, **kw), processing_class=tok, train_dataset=rows)
        return _batch_loss(t)

    both, batch = loss(loss_type=["sigmoid", "sft"], loss_weights=[0.5, 2.0])
    sigmoid, _ = loss(loss_type="sigmoid")
    sft, _ = loss(loss_type="sft")
    assert both == pytest.approx(0.5 * sigmoid + 2.0 * sft, rel=1e-5)
    # "sft" is the chosen completion's NLL, mean per token of each pair, averaged over pairs.
    with torch.no_grad():
        chosen = sequence_logps(_load(path, NOISE), batch).chunk(2)[0]
    n_chosen = completion_token_counts(batch).chunk(2)[0]
    assert sft == pytest.approx((-chosen / n_chosen).mean().item(), rel=1e-5)


def test_weight_column_and_task_weights_scale_each_pair(setup, tmp_path):
    path, tok, rows = setup
    ref = _load(path)
    weights = [float(i % 4) for i in range(len(rows))]
    tasks = ["add" if i % 2 else "other" for i in range(len(rows))]
    weighted = [{**r, "weight": w, "task": t} for r, w, t in zip(rows, weights, tasks, strict=True)]
    trainer = DPOTrainer(_load(path, NOISE), ref, args=_args(tmp_path, task_weights={"add": 3.0}),
                         processing_class=tok, train_dataset=weighted)
    loss, batch = _batch_loss(trainer)
    with torch.no_grad():
        chosen, rejected = sequence_logps(_load(path, NOISE), batch).chunk(2)
        ref_c, ref_r = sequence_logps(ref, batch).chunk(2)
    per_pair, _, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=trainer.args.beta)
    scale = torch.tensor([w * (3.0 if t == "add" else 1.0) for w, t in zip(weights[:8], tasks[:8], strict=True)])
    assert loss == pytest.approx((scale * per_pair).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"task_weights names task\(s\) \['ad'\] that no row has"):
        DPOTrainer(_load(path), ref, args=_args(tmp_path, task_weights={"ad": 2.0}), processing_class=tok,
                   train_dataset=weighted)
    with pytest.raises(ValueError, match=r"row 0: weight = -1.0: must be a finite number >= 0"):
        DPOTrainer(_load(path), ref, args=_args(tmp_path), processing_class=tok,
                   train_dataset=[{**rows[0], "weight": -1.0}])


def test_balanced_batch_sampler():
    groups = ["a"] * 90 + ["b"] * 7 + ["c"] * 3
    sampler = BalancedBatchSampler(groups, 6, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 16
    for batch in batches:
        assert Counter(groups[i] for i in batch) == {"a": 2, "b": 2, "c": 2}
    assert {i for b in batches for i in b} >= set(range(90, 100))  # every small-group row is drawn
    assert list(sampler) != batches  # a new shuffle each pass
    odd = list(BalancedBatchSampler(groups, 4, seed=0))
    assert all(sorted(Counter(groups[i] for i in b).values()) == [1, 1, 2] for b in odd)


def test_trainer_draws_balanced_batches(setup, tmp_path):
    path, tok, rows = setup
    tasks = ["x"] * 56 + ["y"] * 8
    data = [{**r, "task": t} for r, t in zip(rows, tasks, strict=True)]
    trainer = DPOTrainer(_load(path), args=_args(tmp_path, balance_column="task"), processing_class=tok,
                         train_dataset=data)
    order = list(trainer._get_train_sampler())
    assert len(order) == 64
    for start in range(0, 64, 8):
        assert Counter(tasks[i] for i in order[start:start + 8]) == {"x": 4, "y": 4}
    assert len(next(iter(trainer.get_train_dataloader()))["input_ids"]) == 16  # 8 pairs
    # Chat-message prompts can be a balance column too (grouped by their JSON form): rows 0-3 appear twice,
    # yet a batch of 8 takes 8 different prompts.
    data = rows[:4] * 2 + rows[4:16]
    by_prompt = DPOTrainer(_load(path), args=_args(tmp_path, balance_column="prompt"), processing_class=tok,
                           train_dataset=data)
    for start in range(0, 16, 8):
        batch = list(by_prompt._get_train_sampler())[start:start + 8]
        assert len({str(data[i]["prompt"]) for i in batch}) == 8


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"loss_type\[1\] = 'nope': supported: sigmoid") as e:
        _args(tmp_path, loss_type=["sigmoid", "nope"], loss_weights=[1.0], beta=-1.0)
    assert "loss_weights = [1.0]: 1 weight(s) for 2" in str(e.value) and "beta = -1.0" in str(e.value)
    with pytest.raises(ValueError, match=r"loss_type = 'no_such_module:f': cannot import"):
        _args(tmp_path, loss_type="no_such_module:f")
    # reference_free wins over precompute_ref_log_probs (the pipeline's default is true): nothing to precompute
    assert _args(tmp_path, precompute_ref_log_probs=True, reference_free=True).reference_free


def test_precompute_with_lora_uses_the_adapter_disabled_base(setup, tmp_path):
    from peft import LoraConfig, get_peft_model

    path, tok, rows = setup
    model = get_peft_model(_load(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))  # a non-zero adapter
    trainer = DPOTrainer(model, args=_args(tmp_path, precompute_ref_log_probs=True), processing_class=tok,
                         train_dataset=rows[:8])
    assert trainer.ref_model is None
    got = torch.tensor([trainer.train_dataset[c] for c in REF_COLUMNS]).T
    assert torch.allclose(got, reference_logps_table(_load(path), tok, rows[:8], max_length=1024), atol=1e-4)
    assert not torch.allclose(got, reference_logps_table(model, tok, rows[:8], max_length=1024), atol=1e-2)


def test_sync_ref_model_moves_the_reference_and_needs_one(setup, tmp_path):
    """TR-DPO on DPO: after ref_model_sync_steps steps the reference is no longer the starting weights (the KTO
    test checks the mix exactly); with PEFT there is no reference copy to move, which is refused."""
    from peft import LoraConfig

    path, tok, rows = setup
    trainer = DPOTrainer(_load(path), args=_args(tmp_path, sync_ref_model=True, ref_model_sync_steps=1),
                         processing_class=tok, train_dataset=rows)
    start = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, start[n]) for n, p in trainer.ref_model.named_parameters())
    with pytest.raises(ValueError, match="sync_ref_model = true, but this trainer keeps no reference model"):
        DPOTrainer(_load(path), args=_args(tmp_path, sync_ref_model=True), processing_class=tok, train_dataset=rows,
                   peft_config=LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="sync_ref_model = true with precompute_ref_log_probs = true"):
        _args(tmp_path, sync_ref_model=True, precompute_ref_log_probs=True)


@pytest.mark.parametrize("option", [{"ld_alpha": 0.5}, {"use_weighting": True},
                                    {"ld_alpha": 0.0, "use_weighting": True}], ids=lambda o: "-".join(map(str, o)))
def test_ld_alpha_and_use_weighting_train(setup, tmp_path, option):
    """LD-DPO / WPO on builtin:tiny: a few steps, the loss finite, the weights move; the loss on the same batch
    differs from plain DPO's (the option does something)."""
    path, tok, rows = setup
    plain = DPOTrainer(_load(path, NOISE), _load(path), args=_args(tmp_path), processing_class=tok, train_dataset=rows)
    trainer = DPOTrainer(_load(path, NOISE), _load(path), args=_args(tmp_path, **option), processing_class=tok,
                         train_dataset=rows)
    assert _batch_loss(trainer)[0] != pytest.approx(_batch_loss(plain)[0], rel=1e-4)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    if option.get("use_weighting"):
        weights = [h["wpo_weight"] for h in trainer.state.log_history if "wpo_weight" in h]
        assert weights and all(0 < w < 1 for w in weights)


def test_ld_alpha_precomputed_reference_matches_live(setup, tmp_path):
    """The precomputed REF_COLUMNS carry LD-DPO's weighted sums: the same loss as the live reference."""
    path, tok, rows = setup
    live = DPOTrainer(_load(path, NOISE), _load(path), args=_args(tmp_path, ld_alpha=0.3), processing_class=tok,
                      train_dataset=rows)
    pre = DPOTrainer(_load(path, NOISE), _load(path), args=_args(tmp_path, ld_alpha=0.3, precompute_ref_log_probs=True),
                     processing_class=tok, train_dataset=rows)
    assert _batch_loss(pre)[0] == pytest.approx(_batch_loss(live)[0], rel=1e-5)


def test_ld_alpha_out_of_range_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="ld_alpha.*must be in \\[0, 1\\]"):
        _args(tmp_path, ld_alpha=1.5)
