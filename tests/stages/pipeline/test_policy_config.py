"""Stage `policy` builds each trainer config from its params section with no field named in between."""
import dataclasses

import pytest

from stages.params_loader import load_params
from stages.pipeline.training import trainer_config
from tests.conftest import ROOT

CHANGED = {  # non-default values, nested sections included, so a dropped field cannot go unnoticed
    "dpo": {"policy.dpo.beta": 0.3, "policy.dpo.max_length": 256, "policy.dpo.loss_type": ["sigmoid", "sft"],
            "policy.dpo.loss_weights": [1.0, 0.2], "policy.dpo.use_chunked_logprobs": False},
    "kto": {"policy.kto.desirable_weight": 2.0, "policy.kto.max_length": 128},
    "online_dpo": {"policy.online_dpo.generation.temperature": 0.7, "policy.online_dpo.reward_weights": [2.0, 0.1]},
    "grpo": {"policy.grpo.num_generations": 8, "policy.grpo.generation.max_new_tokens": 16,
             "policy.grpo.epsilon_high": 0.28, "policy.grpo.reward_head_coef": 0.5},
    "ppo": {"policy.ppo.missing_eos_penalty": None, "policy.ppo.kl_estimator": "k3", "policy.ppo.gamma": 0.9},
}


@pytest.mark.parametrize("method", list(CHANGED))
def test_trainer_config_carries_every_method_field(tmp_path, method):
    from stages.trainers.dpo import DPOConfig
    from stages.trainers.grpo import GRPOConfig
    from stages.trainers.kto import KTOConfig
    from stages.trainers.online_dpo import OnlineDPOConfig
    from stages.trainers.ppo import PPOConfig

    config_cls = {"dpo": DPOConfig, "kto": KTOConfig, "online_dpo": OnlineDPOConfig, "grpo": GRPOConfig,
                  "ppo": PPOConfig}[method]
    section = getattr(load_params(ROOT / "params.yaml", CHANGED[method]).policy, method)
    args = dict(output_dir=str(tmp_path), learning_rate=1e-3, per_device_train_batch_size=16, max_steps=3,
                num_train_epochs=1.0, use_cpu=True)
    config = trainer_config(config_cls, section, args)
    params_cls = config_cls.__mro__[1]  # DPOParams, ...: the one declaration of the method's fields
    for f in dataclasses.fields(params_cls):
        assert getattr(config, f.name) == getattr(section, f.name), f.name
    for key, value in CHANGED[method].items():  # the changed values did arrive
        node = config
        for part in key.split(".")[2:]:
            node = getattr(node, part)
        assert node == value, key
    assert config.learning_rate == 1e-3 and config.per_device_train_batch_size == 16  # the training keywords win
