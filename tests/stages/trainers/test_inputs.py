"""TRL-shaped trainer arguments (stages.trainers.inputs): a model folder or module, the tokenizer loaded from
the folder, peft_config, datasets in every shape TRL takes, the renamed reward_funcs, pass-through
callbacks and optimizers, and clear errors for what does not fit. Real models and tokenizers saved to
folders (the built-in Llama and tests/architectures.py), no hub."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import datasets
import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, TrainerCallback

from stages.trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOTrainer,
    OnlineDPOConfig,
    OnlineDPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)
from stages.trainers.inputs import check_dataset, load_model
from tests import architectures
from tests.stages.trainers.conftest import build_tiny, builtin_rows

SMOKE = dict(per_device_train_batch_size=4, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
             learning_rate=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def pairs():
    return builtin_rows("preference", "preference", num_preference=16)


def sft_rows(n=8):
    return [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(n)]


def lengths(completions, **kwargs):  # TRL's reward signature: completions by keyword
    return [float(len(c)) for c in completions]


# ---------------------------------------------------------------------------- model and tokenizer

@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_a_model_folder_loads_model_and_tokenizer(arch, tmp_path):
    path = str(architectures.BUILDERS[arch](tmp_path / arch))
    trainer = SFTTrainer(path, args=SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, warmup_steps=0, **SMOKE),
                         train_dataset=sft_rows())
    assert trainer.model.name_or_path == path and trainer.model.dtype == torch.float32  # TRL's default dtype
    assert trainer.processing_class.name_or_path == path and trainer.processing_class.pad_token is not None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if "embed" not in n
               and "wte" not in n and "wpe" not in n)


def test_a_module_built_in_memory_needs_a_processing_class(tiny, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny)
    config._name_or_path = ""  # built from scratch: no folder behind it
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"processing_class is None and the model \(a LlamaForCausalLM built in "
                                         r"memory\) names no folder to load a tokenizer from"):
        DPOTrainer(model, args=DPOConfig(output_dir=str(tmp_path), **SMOKE), train_dataset=[])


def test_model_init_kwargs_set_the_dtype_and_apply_to_folders_only(tiny):
    assert load_model(tiny, SimpleNamespace(model_init_kwargs={"dtype": "bfloat16"})).dtype == torch.bfloat16
    assert load_model(tiny, SimpleNamespace(model_init_kwargs={"dtype": "auto"})).dtype == torch.float32
    with pytest.raises(ValueError, match=r"model_init_kwargs.dtype = 'float64x': not a torch dtype"):
        load_model(tiny, SimpleNamespace(model_init_kwargs={"dtype": "float64x"}))
    module = AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.raises(ValueError, match=r"args.model_init_kwargs given, but model is an instantiated"):
        load_model(module, SimpleNamespace(model_init_kwargs={"dtype": "bfloat16"}))
    with pytest.raises(TypeError, match=r"model = 3: expected a model id, a model folder"):
        load_model(3, None)


def test_no_args_gives_trls_default_output_dir(tiny, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    trainer = KTOTrainer(tiny, train_dataset=builtin_rows("unpaired", "unpaired", num_preference=8))
    assert trainer.args.output_dir.endswith(f"{tiny.rsplit('/', 1)[-1]}-KTO")


# ---------------------------------------------------------------------------- peft_config

def test_peft_config_wraps_the_model_and_leaves_the_callers_config_alone(tiny, pairs, tmp_path):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(tiny, args=DPOConfig(output_dir=str(tmp_path), max_steps=2, **SMOKE), train_dataset=pairs,
                         peft_config=lora)
    assert isinstance(trainer.model, PeftModel) and lora.task_type is None
    assert trainer.model.peft_config["default"].task_type == "CAUSAL_LM" and trainer.ref_model is None
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    trainer.train()
    assert all(not torch.equal(p, trained[n]) for n, p in trainer.model.named_parameters() if n in trained)


def test_peft_config_on_a_reward_model_trains_the_score_head(tiny, pairs, tmp_path):
    trainer = RewardTrainer(tiny, args=RewardConfig(output_dir=str(tmp_path), **SMOKE), train_dataset=pairs,
                            peft_config=LoraConfig(r=4, target_modules="all-linear"))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)


def test_bad_peft_configs_fail_before_training(tiny, pairs, tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), **SMOKE)
    with pytest.raises(ValueError, match=r"peft_config.target_modules = \['qkv'\]: \['qkv'\] not in the model; "
                                         r"the layers LoRA can adapt are .*q_proj"):
        DPOTrainer(tiny, args=args, train_dataset=pairs, peft_config=LoraConfig(target_modules=["qkv"]))
    with pytest.raises(ValueError, match=r"peft_config.task_type = SEQ_CLS: this trainer trains a CAUSAL_LM"):
        DPOTrainer(tiny, args=args, train_dataset=pairs, peft_config=LoraConfig(task_type="SEQ_CLS"))
    from peft import get_peft_model

    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=r"the model already has PEFT adapters"):
        DPOTrainer(wrapped, args=args, train_dataset=pairs, peft_config=LoraConfig())


# ---------------------------------------------------------------------------- datasets

def test_eval_dataset_dict_is_evaluated_under_each_name(tiny, pairs, tmp_path):
    trainer = DPOTrainer(tiny, args=DPOConfig(output_dir=str(tmp_path), **SMOKE), train_dataset=pairs,
                         eval_dataset={"easy": pairs[:4], "hard": datasets.Dataset.from_list(pairs[4:8])})
    metrics = trainer.evaluate()
    assert {"eval_easy_loss", "eval_hard_loss"} <= set(metrics)
    assert metrics["eval_easy_loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: -log σ(0)


def test_an_iterable_dataset_trains(tiny, tmp_path):
    rows = datasets.IterableDataset.from_generator(lambda: iter(sft_rows()))
    trainer = SFTTrainer(tiny, args=SFTConfig(output_dir=str(tmp_path), max_steps=2, **SMOKE), train_dataset=rows)
    assert isinstance(trainer.train_dataset, datasets.IterableDataset)
    trainer.train()
    assert trainer.state.global_step == 2


def test_datasets_of_the_wrong_shape_are_named():
    import pandas as pd

    with pytest.raises(TypeError, match=r"train_dataset: a DataFrame; .*Dataset.from_pandas\(df\)"):
        check_dataset(pd.DataFrame({"text": ["a"]}), "train_dataset")
    with pytest.raises(TypeError, match=r"eval_dataset\['dev'\] row 1: a str; rows are dicts"):
        check_dataset({"dev": [{"text": "a"}, "b"]}, "eval_dataset", allow_dict=True)
    with pytest.raises(TypeError, match=r"train_dataset: a dict of datasets; training takes one dataset"):
        check_dataset({"a": []}, "train_dataset")


# ---------------------------------------------------------------------------- reward_funcs

def test_reward_functions_keyword_still_works_with_a_warning_naming_reward_funcs(tiny, tmp_path):
    prompts = [{"prompt": f"{i} + 1 ="} for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, **SMOKE)
    with pytest.warns(FutureWarning, match=r"GRPOTrainer\(reward_functions=...\) is deprecated .* use reward_funcs"):
        trainer = GRPOTrainer(tiny, reward_functions=[lengths], args=args, train_dataset=prompts)
    assert [n for n, _ in trainer.reward_functions.functions] == ["lengths"]
    with pytest.raises(TypeError, match=r"both reward_functions= and reward_funcs= given"):
        GRPOTrainer(tiny, reward_funcs=lengths, reward_functions=[lengths], args=args, train_dataset=prompts)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['reward_fns'\]"):
        GRPOTrainer(tiny, reward_fns=[lengths], args=args, train_dataset=prompts)


def test_online_dpo_takes_trls_order_and_catches_the_old_one(tiny, tmp_path):
    prompts = [{"prompt": f"{i} + 1 ="} for i in range(4)]
    args = OnlineDPOConfig(output_dir=str(tmp_path), max_steps=1, **SMOKE)
    ref = AutoModelForCausalLM.from_pretrained(tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = OnlineDPOTrainer(tiny, ref, lengths, args, train_dataset=prompts)
    assert trainer.ref_model is ref
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(TypeError, match=r"ref_model = \['exact_match'\] looks like reward functions; the order "
                                        r"is TRL's, OnlineDPOTrainer\(model, ref_model, reward_funcs, ...\)"):
        OnlineDPOTrainer(tiny, ["exact_match"], args=args, train_dataset=prompts)


def test_a_reward_model_folder_is_a_reward_function(tiny, pairs, tmp_path):
    reward = RewardTrainer(tiny, args=RewardConfig(output_dir=str(tmp_path / "rm"), max_steps=1, **SMOKE),
                           train_dataset=pairs)
    reward.train()
    reward.save_model()
    reward.processing_class.save_pretrained(tmp_path / "rm")
    trainer = GRPOTrainer(tiny, reward_funcs=[str(tmp_path / "rm"), lengths], train_dataset=[{"prompt": "1 + 1 ="}],
                          args=GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=2, **SMOKE))
    scores, per_function = trainer.reward_functions(["1 + 1 =", "1 + 1 ="], ["2", "3"])
    assert list(per_function) == [str(tmp_path / "rm"), "lengths"] and all(s is not None for s in scores)
    with pytest.raises(ValueError, match=r"reward_funcs\[0\] is a LlamaForCausalLM object; give a reward model "
                                         r"as its folder"):
        GRPOTrainer(tiny, reward_funcs=[AutoModelForCausalLM.from_pretrained(tiny)],
                    train_dataset=[{"prompt": "1 + 1 ="}], args=GRPOConfig(output_dir=str(tmp_path), **SMOKE))


# ---------------------------------------------------------------------------- passed through to Trainer

def test_callbacks_and_optimizers_reach_the_trainer(tiny, tmp_path):
    class Steps(TrainerCallback):
        seen = 0

        def on_step_end(self, args, state, control, **kwargs):
            Steps.seen += 1

    model = AutoModelForCausalLM.from_pretrained(tiny)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SFTTrainer(model, args=SFTConfig(output_dir=str(tmp_path), max_steps=2, **SMOKE),
                         train_dataset=sft_rows(), callbacks=[Steps()], optimizers=(optimizer, scheduler))
    trainer.train()
    assert Steps.seen == 2 and getattr(trainer.optimizer, "optimizer", trainer.optimizer) is optimizer
