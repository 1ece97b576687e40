"""Stage `policy` builds each trainer config from its params section with no field named in between."""
import dataclasses
from types import SimpleNamespace

import pytest

from stages.harness.params_loader import load_params
from stages.pipeline.training import trainer_config
from stages.trainers.arguments import TRAINING_ARGUMENT_NAMES
from tests.conftest import ROOT

CHANGED = {  # non-default values of method fields and TrainingArguments keys, so a dropped field cannot go unnoticed
    "dpo": {"policy.dpo.beta": 0.2, "policy.dpo.max_length": 256, "policy.dpo.loss_type": ["sigmoid", "sft"],
            "policy.dpo.loss_weights": [1.0, 0.2], "policy.dpo.use_chunked_logprobs": False,
            "policy.dpo.max_grad_norm": 0.5, "policy.dpo.adam_beta2": 0.95},
    "kto": {"policy.kto.desirable_weight": 2.0, "policy.kto.max_length": 128, "policy.kto.weight_decay": 0.1},
    "online_dpo": {"policy.online_dpo.temperature": 0.7, "policy.online_dpo.reward_weights": [2.0, 0.1],
                   "policy.online_dpo.max_new_tokens": 9, "policy.online_dpo.lr_scheduler_type": "linear"},
    "grpo": {"policy.grpo.num_generations": 8, "policy.grpo.max_completion_length": 16,
             "policy.grpo.epsilon_high": 0.28, "policy.grpo.reward_head_coef": 0.5, "policy.grpo.optim": "sgd"},
    "ppo": {"policy.ppo.missing_eos_penalty": None, "policy.ppo.kl_estimator": "k3", "policy.ppo.gamma": 0.9,
            "policy.ppo.vllm_importance_sampling_cap": 3.0},
}


@pytest.mark.parametrize("method", list(CHANGED))
def test_trainer_config_carries_every_field_of_the_section(tmp_path, method):
    params = load_params(ROOT / "params.yaml", CHANGED[method])
    section = getattr(params.policy, method)
    ctx = SimpleNamespace(work=tmp_path, params=params)
    config = trainer_config(ctx, section, device="cpu", section=f"policy.{method}")
    assert type(config).__name__ == type(section).__name__.replace("Section", "Config")
    for f in dataclasses.fields(config):
        if f.name in TRAINING_ARGUMENT_NAMES or not hasattr(section, f.name) or f.metadata.get("deprecated"):
            continue
        assert getattr(config, f.name) == getattr(section, f.name), f.name
    for key, value in CHANGED[method].items():  # the changed values did arrive, TrainingArguments keys too
        assert getattr(config, key.split(".")[2]) == value, key
    assert config.seed == params.run.seed and config.output_dir == str(tmp_path / "checkpoints")


def test_a_value_transformers_refuses_is_reported_by_its_dotted_key(tmp_path):
    params = load_params(ROOT / "params.yaml", {"policy.dpo.eval_strategy": "epoch",
                                                 "policy.dpo.load_best_model_at_end": True})
    ctx = SimpleNamespace(work=tmp_path, params=params)
    with pytest.raises(ValueError, match=r"policy\.dpo\.\w+.*refused by policy\.dpo's trainer config"):
        trainer_config(ctx, params.policy.dpo, device="cpu", section="policy.dpo")


def test_preflight_reports_what_transformers_refuses_before_any_stage(tmp_path):
    """`align run` and a training stage check every trainer config the run will build, before any model."""
    import subprocess
    import sys

    from stages.harness.preflight import trainer_config_problems

    params = load_params(ROOT / "params.yaml", {"policy.dpo.eval_strategy": "epoch",
                                                 "policy.dpo.load_best_model_at_end": True})
    problems = trainer_config_problems(params)
    assert len(problems) == 1 and problems[0].startswith("policy.dpo.") and "load_best_model_at_end" in problems[0]
    assert trainer_config_problems(load_params(ROOT / "params.yaml")) == []
    res = subprocess.run([sys.executable, "-m", "stages", "sft", "--params", str(ROOT / "params.yaml"),
                          "--set", "sft.lr_scheduler_type=cosine", "--set", "sft.optim=no_such_optimizer",
                          "--set", f"run.output_dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "sft.optim" in res.stderr and "refused by sft's trainer config" in res.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_tool_path_that_does_not_resolve_is_refused_before_any_stage(tmp_path):
    """policy.grpo.tools is resolved when params load: each bad path is reported with its index, nothing runs."""
    from stages.harness.params_loader import ParamsError
    from tests.conftest import write_params

    tools = ["stages.builtin.arithmetic_tools.add", "stages.builtin.arithmetic_tools.sub",
             "tests.stages.tools.user_tools:mul"]
    path = write_params(tmp_path, {"policy": {"method": "grpo", "grpo": {"tools": tools}}})
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert ("policy.grpo.tools[1] = 'stages.builtin.arithmetic_tools.sub': stages.builtin.arithmetic_tools has no "
            "'sub'") in str(e.value)
    assert "tools[0]" not in str(e.value) and "tools[2]" not in str(e.value)
