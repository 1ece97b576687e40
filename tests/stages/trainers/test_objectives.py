"""A user-defined objective, imported by dotted path, trains the built-in model without touching stages/."""
import textwrap

import pytest
import torch

from stages.losses import OBJECTIVES, resolve_objective
from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
from tests.stages.trainers.conftest import build_tiny, builtin_rows

USER_CODE = textwrap.dedent('''
    """SimPO-style: length-normalised, reference-free, with a target margin gamma."""
    import torch.nn.functional as F


    def simpo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta,
              chosen_num_tokens, rejected_num_tokens, gamma=0.5, **extras):
        chosen = beta * chosen_logps / chosen_num_tokens
        rejected = beta * rejected_logps / rejected_num_tokens
        return -F.logsigmoid(chosen - rejected - gamma), chosen.detach(), rejected.detach()
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_objectives.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_objectives:simpo"


def test_user_objective_by_dotted_path_trains(tmp_path, user_module):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    rows = builtin_rows("preference", "preference", num_preference=256)
    model = AutoModelForCausalLM.from_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPOConfig(output_dir=str(tmp_path / "out"), loss_type=user_module, beta=2.0, reference_free=True,
                     max_steps=40, per_device_train_batch_size=16, learning_rate=5e-3, logging_steps=1,
                     report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = DPOTrainer(model, args=args, processing_class=tok, train_dataset=rows)
    assert trainer.ref_model is None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert sum(h["loss"] for h in logs[-4:]) < 0.8 * sum(h["loss"] for h in logs[:4])
    assert logs[-1]["rewards/margins"] > logs[0]["rewards/margins"]
    assert not [n for n, p in model.named_parameters() if torch.equal(p, before[n])]


def test_builtin_objectives_and_errors(user_module):
    assert set(OBJECTIVES) >= {"sigmoid", "ipo", "hinge", "sft"}
    assert resolve_objective(user_module).__name__ == "simpo"
    with pytest.raises(ValueError, match="neither a built-in objective"):
        resolve_objective("nope")
    with pytest.raises(ValueError, match=r"cannot import 'missing' from 'my_objectives'"):
        resolve_objective("my_objectives:missing")
