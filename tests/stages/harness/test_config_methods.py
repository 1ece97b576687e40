"""One declaration per method: the params section is the trainer config, read torch-free.

Each method's settings are declared once, on its config (stages/trainers/<method>_config.py, a
TrainingArguments subclass). The params section (`sft`, `reward`, `policy.<method>`) is that class,
executed on a light TrainingArguments, plus the pipeline's own keys; so the two share every field,
default and check.
"""
import dataclasses
import importlib
import subprocess
import sys
import typing

import pytest

from stages.harness.config import STAGE_DEFAULTS, TRAINING_SECTIONS, Params, TrainingStage
from stages.harness.params_loader import load_params
from stages.trainers.arguments import TRAINING_ARGUMENT_NAMES
from tests.conftest import ROOT

# Method fields the pipeline restates with its own default: the weights go with the reward functions it names.
RESTATED = {"reward_weights"}


def config_class(section_cls):
    module, _, name = section_cls.CONFIG.partition(":")
    return getattr(importlib.import_module(module), name)


def section(params, dotted: str):
    for part in dotted.split("."):
        params = getattr(params, part)
    return params


@pytest.mark.parametrize("dotted", list(TRAINING_SECTIONS))
def test_the_section_is_the_trainer_config(dotted):
    """The section's fields are the config's (same names and defaults for every method field), plus the pipeline's
    keys; the section declares no method field of its own."""
    section_cls, config_cls = TRAINING_SECTIONS[dotted], config_class(TRAINING_SECTIONS[dotted])
    assert config_cls.__name__ in [c.__name__ for c in section_cls.__mro__]
    config_fields = {f.name: f for f in dataclasses.fields(config_cls)}
    pipeline = {f.name for f in dataclasses.fields(TrainingStage)} | {  # the bases before the config: the pipeline's
        f.name for base in section_cls.__bases__[:-1] for f in dataclasses.fields(base)}
    assert set(config_fields) <= {f.name for f in dataclasses.fields(section_cls)}
    pipeline_section = section(Params(), dotted)
    config = config_cls(output_dir="/tmp/unused", use_cpu=True)
    for name, f in config_fields.items():
        if name in TRAINING_ARGUMENT_NAMES or name in pipeline or f.metadata.get("deprecated"):
            continue
        if name in RESTATED and hasattr(pipeline_section, "reward_functions"):
            continue
        assert getattr(pipeline_section, name) == getattr(config, name), name
    restated = set(section_cls.__dict__.get("__annotations__", {})) - TRAINING_ARGUMENT_NAMES - pipeline
    assert restated <= RESTATED, restated  # the pipeline's defaults are for TrainingArguments and its own keys


def test_pipeline_defaults_are_training_arguments_keys():
    assert set(STAGE_DEFAULTS) <= TRAINING_ARGUMENT_NAMES


def test_choices_match_the_loss_tables():
    """The Literal choices of the configs are the keys of the tables the losses use."""
    from stages.data.packing import PACKING_STRATEGIES
    from stages.losses import GRPO_AGGREGATIONS, GRPO_REWARD_SCALES, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS

    def choices(dotted, name):
        return set(typing.get_args(typing.get_type_hints(TRAINING_SECTIONS[dotted])[name]))

    assert choices("policy.grpo", "loss_type") == set(GRPO_AGGREGATIONS)
    assert choices("policy.grpo", "scale_rewards") == set(GRPO_REWARD_SCALES)
    assert choices("policy.grpo", "importance_sampling_level") == set(IMPORTANCE_SAMPLING_LEVELS)
    assert choices("policy.ppo", "kl_estimator") == set(KL_ESTIMATORS)
    assert choices("sft", "packing_strategy") == set(PACKING_STRATEGIES)


@pytest.mark.parametrize("key, value, message", [
    ("grpo.epsilon_high", 0.1, "epsilon_high = 0.1: must be >= epsilon (0.2)"),
    ("grpo.num_generations", 1, "num_generations = 1: must be >= 2"),
    ("ppo.kl_estimator", "k9", "kl_estimator = 'k9': expected one of 'k1', 'k3'"),
    ("online_dpo.top_p", 0.0, "top_p = 0.0: must be in (0, 1]"),
    ("kto.beta", -1.0, "beta = -1.0: must be > 0"),
    ("dpo.loss_weights", [1.0, 2.0], "loss_weights = [1.0, 2.0]: 2 weight(s) for 1 loss type(s)"),
])
def test_one_check_from_params_yaml_and_from_python(tmp_path, key, value, message):
    """The same bad value fails with the same message through params.yaml (dotted key) and the Python API."""
    with pytest.raises(ValueError) as from_params:
        load_params(ROOT / "params.yaml", {f"policy.{key}": value})
    assert f"policy.{key.split('.')[0]}.{message.split(' = ')[0]}" in str(from_params.value)
    assert message.split(": ", 1)[1] in str(from_params.value)
    method, _, field = key.partition(".")
    config_cls = config_class(TRAINING_SECTIONS[f"policy.{method}"])
    with pytest.raises(ValueError) as from_python:
        config_cls(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    assert message in str(from_python.value)


@pytest.mark.parametrize("old, new, value", [("sft.max_seq_length", "sft.max_length", 128),
                                             ("policy.grpo.tis_cap", "policy.grpo.vllm_importance_sampling_cap", 3.0),
                                             ("policy.grpo.generation.max_new_tokens",
                                              "policy.grpo.max_completion_length", 9),
                                             ("policy.online_dpo.generation.max_new_tokens",
                                              "policy.online_dpo.max_new_tokens", 9),
                                             ("sft.warmup_ratio", "sft.warmup_steps", 0.1),
                                             ("policy.learning_rate", "policy.dpo.learning_rate", 0.02)])
def test_a_deprecated_key_still_works_with_a_warning_naming_the_new_key(old, new, value):
    with pytest.warns(FutureWarning, match=rf"{old.rsplit('.', 1)[0] if 'generation' in old else old}"):
        p = load_params(ROOT / "params.yaml", {old: value})
    assert section(p, new) == value


def test_a_deprecated_python_argument_warns_and_moves():
    from stages.trainers import GRPOConfig, OnlineDPOConfig, SFTConfig

    with pytest.warns(FutureWarning, match="SFTConfig.max_seq_length is deprecated.*use SFTConfig.max_length"):
        assert SFTConfig(output_dir="/tmp/unused", use_cpu=True, max_seq_length=64).max_length == 64
    with pytest.warns(FutureWarning, match="OnlineDPOConfig.generation is deprecated"):
        assert OnlineDPOConfig(output_dir="/tmp/unused", use_cpu=True,
                               generation={"max_new_tokens": 8}).max_new_tokens == 8
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        assert GRPOConfig(output_dir="/tmp/unused", use_cpu=True, tis_cap=3.0).vllm_importance_sampling_cap == 3.0


def test_every_training_arguments_key_is_reachable_from_params_yaml():
    p = load_params(ROOT / "params.yaml", {"sft.optim": "adamw_torch", "sft.max_grad_norm": 0.5,
                                           "policy.grpo.torch_compile": True, "reward.adam_beta2": 0.95,
                                           "sft.dataloader_num_workers": 2, "sft.dataset_num_proc": 2})
    assert (p.sft.optim, p.sft.max_grad_norm, p.policy.grpo.torch_compile, p.reward.adam_beta2) == \
        ("adamw_torch", 0.5, True, 0.95)
    for dotted, cls in TRAINING_SECTIONS.items():
        assert TRAINING_ARGUMENT_NAMES <= {f.name for f in dataclasses.fields(cls)}, dotted


def test_a_key_the_pipeline_sets_is_refused_with_where_to_set_it():
    with pytest.raises(ValueError, match=r"sft.seed = 3: set by the pipeline from run.seed"):
        load_params(ROOT / "params.yaml", {"sft.seed": 3})
    # TRL's model-loading fields: the stages load the model from the model section, so they would go unused
    with pytest.raises(ValueError, match=r"policy.dpo.trust_remote_code = True: set by the pipeline from "
                                         r"model.trust_remote_code"):
        load_params(ROOT / "params.yaml", {"policy.dpo.trust_remote_code": True})
    with pytest.raises(ValueError, match=r"sft.model_init_kwargs = \{'dtype': 'bfloat16'\}: set by the pipeline from "
                                         r"model.dtype"):
        load_params(ROOT / "params.yaml", {"sft.model_init_kwargs": {"dtype": "bfloat16"}})


def test_params_validation_imports_no_torch():
    """The configs are read torch-free: loading and validating params.yaml stays fast."""
    code = ("import sys; from stages.harness.params_loader import load_params; load_params('params.yaml'); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_light_training_arguments_match_transformers():
    """Names and defaults of the torch-free stand-in equal transformers' TrainingArguments (optim: computed)."""
    from transformers import TrainingArguments

    from stages.trainers.arguments import COMPUTED_DEFAULTS, LightTrainingArguments

    def defaults(cls):
        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}

    real, light = defaults(TrainingArguments), defaults(LightTrainingArguments)
    assert set(real) == set(light)
    assert {k: v for k, v in real.items() if k not in COMPUTED_DEFAULTS} == \
        {k: v for k, v in light.items() if k not in COMPUTED_DEFAULTS}


def test_committed_params_yaml_is_the_rendering_of_the_schema():
    """params.yaml's values and comments cannot drift: it is `align params --write`'s output."""
    from stages.harness.params_yaml import render

    assert (ROOT / "params.yaml").read_text() == render(), "run `align params --write`"


def test_a_trl_field_we_do_not_support_is_named_as_trls_never_ignored(tmp_path):
    with pytest.raises(ValueError) as err:
        load_params(ROOT / "params.yaml", {"policy.grpo.vllm_gpu_memory_utilization": 0.5,
                                           "sft.use_liger_kernel": True})
    message = str(err.value)
    assert ("policy.grpo.vllm_gpu_memory_utilization: TRL 1.16's `vllm_gpu_memory_utilization` is not supported by "
            "stages.trainers yet") in message
    assert "sft.use_liger_kernel: TRL 1.16's `use_liger_kernel` is not supported" in message
    from stages.trainers import DPOConfig, GRPOConfig

    with pytest.raises(TypeError, match=r"GRPOConfig.vllm_enable_sleep_mode: TRL 1.16's `vllm_enable_sleep_mode` is "
                                        r"not supported"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match=r"use_liger_kernel = True: TRL 1.16's `use_liger_kernel` is not supported"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=True)
    DPOConfig(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=False)  # its default is no request


def test_resolved_params_read_back_serialise_identically(tmp_path):
    """A launched stage's ranks read the run's params written out resolved: they must fingerprint alike, so every
    default (TrainingArguments' too) reads back to the same JSON."""
    import json

    import yaml

    params = load_params(ROOT / "params.yaml", {"policy.method": "grpo", "sft.max_grad_norm": 0.5})
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False))
    assert json.dumps(load_params(path).to_dict()) == json.dumps(params.to_dict())


def test_each_section_is_a_class_statement_beside_its_config():
    """`class DPOSection(...)` is in dpo_config.py, as written (grep and go-to-definition find it): the same bases
    the pipeline reads, the config last; its own fields are the pipeline's defaults, each with a reason."""
    import ast

    for section_cls in TRAINING_SECTIONS.values():
        module = section_cls.CONFIG.partition(":")[0]
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == section_cls.__name__)
        assert [base.id for base in node.bases] == [base.__name__ for base in section_cls.__bases__]
        assert section_cls.__bases__[-1].__name__ == section_cls.CONFIG.partition(":")[2]
        own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
        fields = {f.name: f for f in dataclasses.fields(section_cls)}
        assert all(fields[k].metadata["stage_default"] for k in own), section_cls.__name__
        assert all(fields[k].metadata["stage_default"] for k in STAGE_DEFAULTS)


def test_a_section_declares_no_key_of_its_own():
    """A key only the section declared would be in params.yaml but not in the Python API: refused."""
    from stages.fields import param
    from stages.trainers.pipeline_section import TrainingStage, section, stage_default
    from stages.trainers.sft_config import SFTConfig

    with pytest.raises(TypeError, match="BadSection.extra: a section declares no key of its own"):
        @section
        class BadSection(TrainingStage, SFTConfig):
            extra: int = param(1, help="only here")
    with pytest.raises(TypeError, match="BadSection.made_up: a section declares no key"):
        @section
        class BadSection(TrainingStage, SFTConfig):  # noqa: F811
            made_up: int = stage_default(1, "no config declares it")
    with pytest.raises(TypeError, match=r"BadSection.learning_rate = 5e-05 is the default it has already"):
        @section
        class BadSection(TrainingStage, SFTConfig):  # noqa: F811
            learning_rate: float = stage_default(5e-5, "TrainingArguments' own: one default per key")
