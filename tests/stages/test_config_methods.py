"""One dataclass per policy method: the params section, the trainer config and their defaults agree.

Each method's settings are declared once (stages/trainers/<method>_params.py). The params
section (`policy.<method>`) and the trainer config (`<Method>Config`, the Python API) both
derive from that class, so they have the same fields, defaults and checks.
"""
import dataclasses
import subprocess
import sys

import pytest

from stages.config import RESTATED, Params
from stages.params_loader import load_params
from stages.trainers.dpo_params import DPOParams
from stages.trainers.grpo_params import GRPOParams
from stages.trainers.kto_params import KTOParams
from stages.trainers.online_dpo_params import OnlineDPOParams
from stages.trainers.ppo_params import PPOParams
from stages.trainers.reward_params import RewardModelParams
from stages.trainers.sft_params import SFTParams
from tests.conftest import ROOT


def trainer_configs():
    """{dotted params section: (the method's params class, its trainer config)} for every trainer."""
    from stages.trainers.dpo import DPOConfig
    from stages.trainers.grpo import GRPOConfig
    from stages.trainers.kto import KTOConfig
    from stages.trainers.online_dpo import OnlineDPOConfig
    from stages.trainers.ppo import PPOConfig
    from stages.trainers.reward import RewardConfig
    from stages.trainers.sft import SFTConfig

    return {"policy.dpo": (DPOParams, DPOConfig), "policy.kto": (KTOParams, KTOConfig),
            "policy.online_dpo": (OnlineDPOParams, OnlineDPOConfig), "policy.grpo": (GRPOParams, GRPOConfig),
            "policy.ppo": (PPOParams, PPOConfig), "sft": (SFTParams, SFTConfig),
            "reward": (RewardModelParams, RewardConfig)}


def section(params, dotted: str):
    for part in dotted.split("."):
        params = getattr(params, part)
    return params


def disagreeing_defaults(tmp_path) -> list[str]:
    """`<section>.<field>: pipeline vs Python API` for every method field whose defaults differ."""
    out = []
    for key, (params_cls, config_cls) in trainer_configs().items():
        pipeline = section(Params(), key)
        config = config_cls(output_dir=str(tmp_path), use_cpu=True)
        for f in dataclasses.fields(params_cls):
            if f.name in RESTATED and hasattr(pipeline, "reward_functions"):
                continue  # the pipeline's weights go with its own reward_functions
            if getattr(pipeline, f.name) != getattr(config, f.name):
                out.append(f"{key}.{f.name}: {getattr(pipeline, f.name)!r} vs {getattr(config, f.name)!r}")
    return out


def test_python_api_defaults_equal_the_pipelines(tmp_path):
    """GRPOConfig(output_dir=...) and Params().policy.grpo (and every other trainer) share every method default."""
    assert disagreeing_defaults(tmp_path) == []


def test_section_and_trainer_config_are_the_same_declaration():
    """No method field is restated: the section and the trainer config subclass the method's params class
    and declare no method field of their own."""
    for key, (params_cls, config_cls) in trainer_configs().items():
        section_cls = type(section(Params(), key))
        assert issubclass(section_cls, params_cls) and issubclass(config_cls, params_cls)
        names = {f.name for f in dataclasses.fields(params_cls)}
        assert not names & set(config_cls.__dict__.get("__annotations__", {})), (key, config_cls)
        restated = names & set(section_cls.__dict__.get("__annotations__", {}))
        assert restated <= set(RESTATED) and (not restated or "reward_functions" in section_cls.__dict__.get(
            "__annotations__", {})), (key, restated)  # only the weights, beside the section's own functions


def test_choices_match_the_loss_tables():
    """The Literal choices of the light params modules are the keys of the tables the losses use."""
    import typing

    from stages.data.packing import PACKING_STRATEGIES
    from stages.losses import GRPO_AGGREGATIONS, GRPO_REWARD_SCALES, KL_ESTIMATORS

    def choices(cls, name):
        return set(typing.get_args(typing.get_type_hints(cls)[name]))

    assert choices(GRPOParams, "loss_type") == set(GRPO_AGGREGATIONS)
    assert choices(GRPOParams, "scale_rewards") == set(GRPO_REWARD_SCALES)
    assert choices(PPOParams, "kl_estimator") == set(KL_ESTIMATORS)
    assert choices(SFTParams, "packing_strategy") == set(PACKING_STRATEGIES)


@pytest.mark.parametrize("key, value, message", [
    ("grpo.epsilon_high", 0.1, "epsilon_high = 0.1: must be >= epsilon (0.2)"),
    ("grpo.num_generations", 1, "num_generations = 1: must be >= 2"),
    ("ppo.kl_estimator", "k9", "kl_estimator = 'k9': expected one of 'k1', 'k3'"),
    ("online_dpo.generation.top_p", 0.0, "generation.top_p = 0.0: must be in (0, 1]"),
    ("kto.beta", -1.0, "beta = -1.0: must be > 0"),
    ("dpo.loss_weights", [1.0, 2.0], "loss_weights = [1.0, 2.0]: 2 weight(s) for 1 loss type(s)"),
])
def test_one_check_from_params_yaml_and_from_python(tmp_path, key, value, message):
    """The same bad value fails with the same message through params.yaml (dotted key) and the Python API."""
    with pytest.raises(ValueError) as from_params:
        load_params(ROOT / "params.yaml", {f"policy.{key}": value})
    assert f"policy.{key.split('.')[0]}.{message}" in str(from_params.value)
    method, _, field = key.partition(".")
    _, config_cls = trainer_configs()[f"policy.{method}"]
    kwargs = {field: value}
    if field.startswith("generation."):
        from stages.trainers.online_sampling import GenerationParams

        kwargs = {"generation": GenerationParams(**{field.partition(".")[2]: value})}
    with pytest.raises(ValueError) as from_python:
        config_cls(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert message in str(from_python.value)


def test_params_validation_imports_no_torch():
    """The method params live in light modules: loading and validating params.yaml stays fast."""
    code = ("import sys; from stages.config import load_params; load_params('params.yaml'); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_params_yaml_lists_every_policy_key():
    """params.yaml stays the full, commented listing of the policy section (the one other place a new
    method parameter goes): every key of every method, nested sections included."""
    import yaml

    def leaves(d, prefix=""):
        return {k for key, v in d.items() for k in (leaves(v, f"{prefix}{key}.") if isinstance(v, dict)
                                                       else {prefix + key})}

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())["policy"]
    declared = leaves(Params().to_dict()["policy"])
    assert sorted(declared - leaves(raw)) == []
