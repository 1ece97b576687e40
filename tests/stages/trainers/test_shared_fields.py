"""TRL's loading and batching fields every trainer shares (stages.trainers.method_fields, inputs): model_init_kwargs
and trust_remote_code on every config, chat_template_path / eos_token / pad_token on SFT, reward and DPO,
pad_to_multiple_of, padding_free, disable_dropout. Real tiny models saved to folders, no hub."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    KTOConfig,
    KTOTrainer,
    OnlineDPOConfig,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)
from tests.stages.trainers.conftest import build_tiny, builtin_rows

SMOKE = dict(per_device_train_batch_size=4, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
             max_steps=1)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny(tmp_path_factory.mktemp("tiny")))


def sft_rows(n=8):
    return [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(n)]


@pytest.mark.parametrize("config", [SFTConfig, RewardConfig, DPOConfig, KTOConfig, OnlineDPOConfig, GRPOConfig])
def test_every_config_has_trls_model_loading_fields(config):
    fields = {f.name: f.default for f in dataclasses.fields(config)}
    assert fields["model_init_kwargs"] is None and fields["trust_remote_code"] is False


def test_model_init_kwargs_from_the_config_load_the_model(tiny, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), model_init_kwargs={"dtype": "bfloat16"}, **SMOKE)
    trainer = SFTTrainer(tiny, args=args, train_dataset=sft_rows())
    assert trainer.model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"SFTConfig: 1 problem.*\n  - model_init_kwargs = 'bfloat16': must be a"):
        SFTConfig(output_dir=str(tmp_path), model_init_kwargs="bfloat16")


def test_chat_template_path_eos_token_and_pad_token_set_the_tokenizer(tiny, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    args = SFTConfig(output_dir=str(tmp_path), chat_template_path=str(template), eos_token="<|user|>",
                     pad_token="<|system|>", **SMOKE)
    rows = [{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}]
    trainer = SFTTrainer(tiny, args=args, train_dataset=rows)
    tok = trainer.processing_class
    assert tok.chat_template == CHATML and tok.eos_token == "<|user|>" and tok.pad_token == "<|system|>"
    assert tok.decode(trainer.train_dataset[0]["input_ids"]).startswith("<|im_start|>user\n1+1")
    eos = tok.convert_tokens_to_ids("<|user|>")
    assert trainer.model.config.eos_token_id == eos and trainer.model.generation_config.eos_token_id[0] == eos
    assert trainer.data_collator.pad_token_id == tok.convert_tokens_to_ids("<|system|>")


def test_chat_template_path_takes_a_tokenizer_folder(tiny, tmp_path):
    donor = AutoTokenizer.from_pretrained(tiny)
    donor.chat_template = CHATML
    donor.save_pretrained(tmp_path / "donor")
    args = RewardConfig(output_dir=str(tmp_path), chat_template_path=str(tmp_path / "donor"), **SMOKE)
    trainer = RewardTrainer(tiny, args=args, train_dataset=builtin_rows("preference", "preference", num_preference=4))
    assert trainer.processing_class.chat_template == CHATML


def test_bad_tokenizer_fields_are_explained(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"SFTConfig.eos_token = '<\|nope\|>': not a token of the tokenizer's"):
        SFTTrainer(tiny, args=SFTConfig(output_dir=str(tmp_path), eos_token="<|nope|>", **SMOKE),
                   train_dataset=sft_rows())
    bad = tmp_path / "template.txt"
    bad.write_text(CHATML)
    with pytest.raises(ValueError, match=r"chat_template_path = .*template.txt': a file must be a Jinja template"):
        SFTTrainer(tiny, args=SFTConfig(output_dir=str(tmp_path), chat_template_path=str(bad), **SMOKE),
                   train_dataset=sft_rows())
    donor = AutoTokenizer.from_pretrained(tiny)
    donor.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    donor.chat_template = CHATML.replace("<|end|>", "<|im_end|>")
    donor.save_pretrained(tmp_path / "donor")
    with pytest.raises(ValueError, match=r"uses special tokens \['<\|im_end\|>'\] that the training tokenizer lacks"):
        SFTTrainer(tiny, args=SFTConfig(output_dir=str(tmp_path), chat_template_path=str(tmp_path / "donor"),
                                        **SMOKE), train_dataset=sft_rows())


@pytest.mark.parametrize("trainer_cls, config_cls, rows, key", [
    (SFTTrainer, SFTConfig, "sft", "input_ids"),
    (DPOTrainer, DPOConfig, "preference", "input_ids"),
    (KTOTrainer, KTOConfig, "unpaired", "input_ids"),
    (RewardTrainer, RewardConfig, "preference", "input_ids"),
])
def test_pad_to_multiple_of_rounds_every_batch_up(tiny, tmp_path, trainer_cls, config_cls, rows, key):
    data = {"sft": sft_rows(), "preference": builtin_rows("preference", "preference", num_preference=8),
            "unpaired": builtin_rows("unpaired", "unpaired", num_preference=8)}[rows]

    def width(multiple):
        trainer = trainer_cls(tiny, args=config_cls(output_dir=str(tmp_path), pad_to_multiple_of=multiple, **SMOKE),
                              train_dataset=data)
        return trainer.data_collator([trainer.train_dataset[i] for i in range(3)])[key].shape[1]

    natural = width(None)
    assert width("auto") == natural  # TRL's default pads only on AWS Neuron
    assert width(natural + 3) == natural + 3  # rounded up to the next multiple
    assert width((natural + 1) // 2) == 2 * ((natural + 1) // 2)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of = 0: must be a positive integer, 'auto' or null"):
        config_cls(output_dir=str(tmp_path), pad_to_multiple_of=0)


def test_sft_padding_free_joins_the_batch_into_one_row_with_the_same_loss(tiny, tmp_path):
    torch.manual_seed(0)
    losses = {}
    for free in (False, True):
        trainer = SFTTrainer(AutoModelForCausalLM.from_pretrained(tiny), train_dataset=sft_rows(),
                             args=SFTConfig(output_dir=str(tmp_path), padding_free=free, **SMOKE),
                             processing_class=AutoTokenizer.from_pretrained(tiny))
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        assert (batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch) == free
        with torch.no_grad():
            losses[free] = trainer.compute_loss(trainer.model, batch).item()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.parametrize("disable", [True, False])
def test_disable_dropout_turns_dropout_off_in_model_and_reference(tiny, tmp_path, disable):
    """TRL's default (True) on DPO, KTO, reward and online DPO: every nn.Dropout and the attention-dropout rate of
    the policy and of the reference given as ref_model; False leaves them as the model's config sets them."""
    def with_dropout():
        model = AutoModelForCausalLM.from_pretrained(tiny, attention_dropout=0.3)
        model.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.2), model.lm_head)  # an nn.Dropout to switch off
        return model

    def rates(model):
        return ({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
                | {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")})

    policy, reference = with_dropout(), with_dropout()
    trainer = DPOTrainer(policy, reference, args=DPOConfig(output_dir=str(tmp_path), disable_dropout=disable,
                                                           precompute_ref_log_probs=False, **SMOKE),
                         processing_class=AutoTokenizer.from_pretrained(tiny),
                         train_dataset=builtin_rows("preference", "preference", num_preference=4))
    expected = {0.0} if disable else {0.2, 0.3}
    assert rates(trainer.model) == expected and rates(trainer.ref_model) == expected


@pytest.mark.parametrize("offload", [False, True])
def test_activation_offloading_routes_saved_tensors_through_the_offload_hooks(tiny, tmp_path, offload):
    """Offloaded, what autograd saves during the forward goes through save_on_cpu's pack/unpack hooks instead of
    autograd's own store: an in-place change of an input after the forward, which autograd's version check refuses
    at backward, passes. (On CPU the packed tensor is the tensor itself, already in CPU memory, so the backward
    sees the changed values; on a GPU it is a CPU copy.)"""
    trainer = SFTTrainer(tiny, args=SFTConfig(output_dir=str(tmp_path), activation_offloading=offload, **SMOKE),
                         train_dataset=sft_rows())
    weight, x = torch.ones(3, requires_grad=True), torch.tensor([1.0, 2.0, 3.0])
    with trainer.compute_loss_context_manager():
        y = (weight * x).sum()
    x.mul_(10)
    if offload:
        y.backward()
        assert weight.grad.tolist() == [10.0, 20.0, 30.0]
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("trainer_cls, config_cls, rows", [
    (SFTTrainer, SFTConfig, "sft"), (DPOTrainer, DPOConfig, "preference"), (KTOTrainer, KTOConfig, "unpaired"),
    (RewardTrainer, RewardConfig, "preference"),
])
def test_activation_offloading_trains_to_the_same_weights(tiny, tmp_path, trainer_cls, config_cls, rows):
    data = {"sft": sft_rows(), "preference": builtin_rows("preference", "preference", num_preference=8),
            "unpaired": builtin_rows("unpaired", "unpaired", num_preference=8)}[rows]
    weights = []
    for offload in (False, True):
        torch.manual_seed(0)
        args = config_cls(output_dir=str(tmp_path), activation_offloading=offload, **{**SMOKE, "max_steps": 2},
                          learning_rate=1e-2, seed=0)
        trainer = trainer_cls(tiny, args=args, train_dataset=data)
        trainer.train()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    assert all(torch.allclose(weights[0][n], weights[1][n], atol=1e-6) for n in weights[0])
