"""TRL's `router_aux_loss_coef` in SFT, DPO, KTO and RLOO: on a tiny randomly initialised Mixtral (4 experts, top 2,
its config's coefficient 0.02) each trainer's loss is its method's loss plus exactly coef x the router's
load-balancing loss of the policy's forward, computed here by the model itself; null takes the config's
coefficient, 0 switches it off, and a dense model refuses a coefficient. (GRPO: tests/stages/trainers/
test_grpo_parity.py.)"""
from __future__ import annotations

import pytest
import torch

from stages.trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer, SFTConfig, SFTTrainer
from stages.trainers.model_options import router_losses
from tests.stages.trainers.conftest import build_tiny, builtin_rows

CONFIG_COEF = 0.02


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


def tiny_moe(tok):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           router_aux_loss_coef=CONFIG_COEF, tie_word_embeddings=False,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return MixtralForCausalLM(config)


def _common(tmp_path):
    return dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                seed=0, per_device_train_batch_size=4)


def _loss(trainer, batch):
    trainer.model.train()
    return trainer.compute_loss(trainer.model, dict(batch)).detach()


def _aux(model, inputs):
    """The model's own load-balancing loss of these rows (what the trainers must add, times the coefficient)."""
    with torch.no_grad():
        return model(**inputs, use_cache=False, output_router_logits=True).aux_loss


def _check(make, batch_of, inputs_of, coef, expected):
    """make(coef) -> trainer; batch_of(trainer) -> a batch; inputs_of(batch) -> the policy forward's inputs."""
    trainer = make(coef)
    assert trainer.router_aux_loss_coef == expected
    batch = batch_of(trainer)
    plain = _loss(make(0.0), batch)
    with_aux = _loss(trainer, batch)
    aux = _aux(trainer.model, inputs_of(batch))
    assert aux > 0
    torch.testing.assert_close(with_aux - plain, expected * aux, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("coef, expected", [(0.5, 0.5), (None, CONFIG_COEF)])
def test_sft_adds_the_router_loss(tok, tmp_path, coef, expected):
    model = tiny_moe(tok)
    rows = builtin_rows("sft", "messages", num_train=8, num_preference=2)

    def make(c):
        return SFTTrainer(model, args=SFTConfig(**_common(tmp_path), router_aux_loss_coef=c), processing_class=tok,
                          train_dataset=rows)

    _check(make, lambda t: next(iter(t.get_train_dataloader())),
           lambda b: {k: b[k] for k in ("input_ids", "attention_mask")}, coef, expected)


def test_dpo_adds_the_router_loss_of_the_unpacked_pair_rows(tok, tmp_path):
    model = tiny_moe(tok)
    rows = builtin_rows("preference", "preference", num_preference=8)

    def make(c):
        return DPOTrainer(model, args=DPOConfig(**_common(tmp_path), router_aux_loss_coef=c,
                                                precompute_ref_log_probs=False),
                          processing_class=tok, train_dataset=rows)

    _check(make, lambda t: next(iter(t.get_train_dataloader())),
           lambda b: {k: b[k] for k in ("input_ids", "attention_mask")}, 0.5, 0.5)


@pytest.mark.parametrize("loss_type", ["apo_zero_unpaired", "kto"])
def test_kto_adds_the_router_loss(tok, tmp_path, loss_type):
    """kto: the matched and KL rows run in one forward (unpacked), whose router loss is added."""
    from stages.trainers.kto_trainer import _pairs, _part

    model = tiny_moe(tok)
    rows = builtin_rows("unpaired", "unpaired", num_preference=16)

    def make(c):
        return KTOTrainer(model, args=KTOConfig(**_common(tmp_path), router_aux_loss_coef=c, loss_type=loss_type),
                          processing_class=tok, train_dataset=rows)

    def inputs_of(batch):
        rows = _part(batch, "") if loss_type == "apo_zero_unpaired" else _pairs(batch)
        return {k: rows[k] for k in ("input_ids", "attention_mask")}

    _check(make, lambda t: t._prepare_inputs(next(iter(t.get_train_dataloader()))), inputs_of, 0.5, 0.5)


def test_rloo_adds_the_router_loss(tok, tmp_path):
    from stages.trainers.rollout import position_ids

    model = tiny_moe(tok)
    prompts = builtin_rows("prompts", "prompt_only", num_train=4)

    def make(c):
        args = RLOOConfig(**{**_common(tmp_path), "per_device_train_batch_size": 4}, num_generations=2,
                          max_completion_length=4, beta=0.0, router_aux_loss_coef=c)
        return RLOOTrainer(model, lambda prompts, completions, **_: [float(len(c)) for c in completions], args,
                           train_dataset=prompts, processing_class=tok)

    _check(make, lambda t: t.make_batch(prompts[:2]),
           lambda b: {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                      "position_ids": position_ids(b["attention_mask"])}, 0.5, 0.5)


def test_zero_switches_it_off_and_a_dense_model_refuses_a_coefficient(tok, tmp_path):
    rows = builtin_rows("sft", "messages", num_train=8, num_preference=2)
    trainer = SFTTrainer(tiny_moe(tok), args=SFTConfig(**_common(tmp_path), router_aux_loss_coef=0.0),
                         processing_class=tok, train_dataset=rows)
    assert trainer.router_aux_loss_coef == 0.0
    with router_losses(trainer.model, trainer.router_aux_loss_coef > 0) as aux:
        _loss(trainer, next(iter(trainer.get_train_dataloader())))
    assert aux == []  # the router logits were not even asked for
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tok.name_or_path)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef = 0.1, but LlamaForCausalLM is not a "
                                         r"Mixture-of-Experts model"):
        DPOTrainer(dense, args=DPOConfig(**_common(tmp_path), router_aux_loss_coef=0.1), processing_class=tok,
                   train_dataset=builtin_rows("preference", "preference", num_preference=8))


def test_training_with_accumulation_logs_the_router_loss_and_moves_the_router(tok, tmp_path):
    """Two micro-batches per step (SFT's loss is scaled for accumulation, so the router loss takes its share):
    the logged aux_loss is the model's, and the router gates get a gradient the plain loss would not give."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grad = model.model.layers[0].mlp.gate.weight.grad.clone()

    rows = builtin_rows("sft", "messages", num_train=8, num_preference=2)
    grads = {}
    for coef in (0.0, 5.0):
        grab = Grab()
        args = SFTConfig(**{**_common(tmp_path), "per_device_train_batch_size": 2}, gradient_accumulation_steps=2,
                         max_steps=1, logging_steps=1, router_aux_loss_coef=coef)
        trainer = SFTTrainer(tiny_moe(tok), args=args, processing_class=tok, train_dataset=rows, callbacks=[grab])
        trainer.train()
        grads[coef] = grab.grad
        logged = trainer.state.log_history[0]
        assert ("aux_loss" in logged) == (coef > 0)
    assert 0 < logged["aux_loss"] < 4  # num_experts x sum(f_i P_i) is about top_k = 2 for a balanced router
    assert not torch.allclose(grads[5.0], grads[0.0])
