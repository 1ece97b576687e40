"""Our trainers' losses against TRL 1.16's on the same batch, for the variants this project added after TRL.

Each case builds TRL's trainer and ours on the same tiny model, reference model (another seed, so the
log-ratios are not 0) and rows, and compares one batch's loss without a step. The hand-derived values of
the same formulas are in tests/stages/losses/. Skipped without trl (`pip install -e .[bench]`).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e .[bench]): nothing to compare with")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.stages.trainers.conftest import build_tiny  # noqa: E402

COMMON = {"per_device_train_batch_size": 4, "report_to": "none", "use_cpu": True, "bf16": False,
          "gradient_checkpointing": False, "max_length": 64, "save_strategy": "no"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from stages.builtin import tiny

    policy = build_tiny(tmp_path_factory.mktemp("policy"))
    reference = str(tiny.build(tmp_path_factory.mktemp("reference"), hidden_size=32, num_layers=1, num_heads=2,
                               intermediate_size=64, vocab_size=384, seed=1))
    return policy, reference


def both_losses(models, tmp_path, ours: tuple, theirs: tuple, rows: Dataset, **config) -> list[float]:
    """[TRL's loss, our loss] on each trainer's first training batch (the same rows, unshuffled)."""
    policy, reference = models
    out = []
    for config_cls, trainer_cls in (theirs, ours):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(AutoModelForCausalLM.from_pretrained(policy),
                                  ref_model=AutoModelForCausalLM.from_pretrained(reference),
                                  args=config_cls(output_dir=str(tmp_path), **COMMON, **config),
                                  train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(policy))
        collated = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
        batch = trainer._prepare_inputs(collated)
        with torch.no_grad():
            out.append(trainer.compute_loss(trainer.model, batch).item())
    return out


PAIRS = Dataset.from_dict({"prompt": ["What is 2+3?", "What is 4+4?"], "chosen": [" 5", " 8"],
                           "rejected": [" 6", " 9 or 10"]})


@pytest.mark.parametrize("config", [
    {"loss_type": "sigmoid"},
    {"loss_type": "discopop", "discopop_tau": 0.05},
    {"loss_type": "discopop", "discopop_tau": 1.0},
    {"loss_type": "sigmoid", "f_divergence_type": "forward_kl"},
    {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
    {"loss_type": "hinge", "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    {"loss_type": "sigmoid", "ld_alpha": 0.5},
    {"loss_type": "sigmoid", "ld_alpha": 0.0},
    {"loss_type": "sigmoid", "use_weighting": True},
    {"loss_type": "ipo", "ld_alpha": 0.3, "use_weighting": True},
], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_dpo_loss_variants_match_trl(models, tmp_path, config):
    from stages.trainers import DPOConfig, DPOTrainer

    theirs, ours = both_losses(models, tmp_path, (DPOConfig, DPOTrainer), (trl.DPOConfig, trl.DPOTrainer), PAIRS,
                               beta=0.5, precompute_ref_log_probs=False, **config)
    assert math.isclose(ours, theirs, rel_tol=1e-5), (ours, theirs)


UNPAIRED = Dataset.from_dict({"prompt": ["What is 2+3?", "What is 4+4?", "What is 1+1?", "What is 3+3?"],
                              "completion": [" 5", " 9 or 10", " 2", " 7"], "label": [True, False, True, False]})


@pytest.mark.parametrize("precompute", [False, True])
def test_kto_apo_zero_unpaired_matches_trl(models, tmp_path, precompute):
    """apo_zero_unpaired needs no KL estimate, so both trainers see the same terms (TRL's KL pairs differ from
    ours); with precompute_ref_log_probs the reference comes from the precomputed columns on both sides."""
    from stages.trainers import KTOConfig, KTOTrainer

    theirs, ours = both_losses(models, tmp_path, (KTOConfig, KTOTrainer), (trl.KTOConfig, trl.KTOTrainer), UNPAIRED,
                               beta=0.5, loss_type="apo_zero_unpaired", precompute_ref_log_probs=precompute,
                               desirable_weight=1.5)
    assert math.isclose(ours, theirs, rel_tol=1e-5), (ours, theirs)


def test_sft_dft_loss_matches_trl(models, tmp_path):
    """SFT's loss_type="dft" on a conversational batch: TRL's SFTTrainer and ours give the same loss."""
    from stages.trainers import SFTConfig, SFTTrainer

    policy, _ = models
    rows = Dataset.from_dict({"messages": [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                                           for q, a in (("What is 2+3?", "5"), ("What is 4+4?", "9 or 10"))]})
    out = []
    for config_cls, trainer_cls, loss_type in ((trl.SFTConfig, trl.SFTTrainer, "dft"), (SFTConfig, SFTTrainer, "dft"),
                                               (SFTConfig, SFTTrainer, "nll")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(AutoModelForCausalLM.from_pretrained(policy), train_dataset=rows,
                                  args=config_cls(output_dir=str(tmp_path), loss_type=loss_type, **COMMON),
                                  processing_class=AutoTokenizer.from_pretrained(policy))
        batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(2)]))
        with torch.no_grad():
            out.append(trainer.compute_loss(trainer.model, batch).item())
    theirs, ours, nll = out
    assert math.isclose(ours, theirs, rel_tol=1e-5), (ours, theirs)
    assert not math.isclose(ours, nll, rel_tol=1e-2)  # the weighting is visible on this batch


CONVERSATION = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("rows, config", [
    ({"messages": [CONVERSATION]}, {}),
    ({"messages": [CONVERSATION]}, {"assistant_only_loss": True}),
    ({"prompt": [CONVERSATION[:3]], "completion": [CONVERSATION[3:]]}, {}),
    ({"prompt": [CONVERSATION[:3]], "completion": [CONVERSATION[3:]]}, {"assistant_only_loss": True}),
    ({"prompt": [CONVERSATION[:3]], "completion": [CONVERSATION[3:]]},
     {"assistant_only_loss": True, "completion_only_loss": False}),
], ids=["messages", "messages-assistant", "prompt-completion", "prompt-completion-assistant",
        "prompt-completion-assistant-all"])
def test_sft_tokens_and_loss_positions_match_trl(models, tmp_path, rows, config):
    """The same conversational rows through TRL's SFTTrainer and ours: the same input ids and the same labels
    (which tokens are trained), for TRL's row shapes and its assistant_only_loss / completion_only_loss."""
    from stages.trainers import SFTConfig, SFTTrainer

    policy, _ = models
    batches = []
    for config_cls, trainer_cls in ((trl.SFTConfig, trl.SFTTrainer), (SFTConfig, SFTTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(str(policy), train_dataset=Dataset.from_dict(rows),
                                  args=config_cls(output_dir=str(tmp_path), **COMMON, **config))
        batch = trainer.data_collator([trainer.train_dataset[0]])
        batches.append((batch["input_ids"][0].tolist(), batch["labels"][0].tolist()))
    assert batches[1] == batches[0]
