"""stages.reward_model: the reward is read at each row's last real token whatever the pad token, and heads that
are not one scalar are refused by name. (Scoring and evaluation against training: test_reward_trainer.py.)"""
import copy

import pytest
import torch

from stages.reward_model import load_reward_model, sequence_rewards
from stages.trainers.reward_trainer import RewardCollator, tokenize_pairs
from tests.stages.trainers.test_reward_trainer import _model, setup  # noqa: F401 (setup: the module's fixture)


def test_reward_is_read_at_the_last_real_token_even_when_pad_is_eos(setup):  # noqa: F811
    """Dedicated pad token: our reading equals HF's own pooling. pad == EOS: it equals each row's last
    position run alone (no padding), while HF's pooling would read one token early (the final EOS
    looks like padding)."""
    path, tok, rows = setup
    model = _model(path, tok).eval()
    batch = RewardCollator(tok.pad_token_id)(tokenize_pairs(tok, rows[:4], 256))
    ours = sequence_rewards(model, batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(ours, model(**batch).logits[:, 0], atol=1e-6)

    eos_tok = copy.deepcopy(tok)
    eos_tok.pad_token = eos_tok.eos_token
    batch = RewardCollator(eos_tok.pad_token_id)(tokenize_pairs(eos_tok, rows[:4], 256))
    assert batch["attention_mask"].sum(-1).unique().numel() > 1  # really padded
    ours = sequence_rewards(model, batch["input_ids"], batch["attention_mask"])
    alone = torch.stack([model(input_ids=ids[m.bool()][None]).logits[0, 0]  # config pad (<|pad|>) absent here
                         for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)])
    assert torch.allclose(ours, alone, atol=1e-5)
    model.config.pad_token_id = eos_tok.pad_token_id
    assert not torch.allclose(ours, model(**batch).logits[:, 0], atol=1e-3)


def test_heads_with_several_outputs_and_missing_heads_are_refused(setup, tmp_path):  # noqa: F811
    from transformers import AutoModelForSequenceClassification

    path, tok, _ = setup
    AutoModelForSequenceClassification.from_pretrained(path, num_labels=3).save_pretrained(tmp_path / "cls3")
    with pytest.raises(ValueError, match=r"cls3: its classification head \(LlamaForSequenceClassification\) has 3 "
                                         r"outputs; a reward model has exactly one"):
        load_reward_model(str(tmp_path / "cls3"), tok)
    with pytest.raises(ValueError, match=r"is not a reward model \(architectures: \['LlamaForCausalLM'\]"):
        load_reward_model(path, tok, require_head=True)
