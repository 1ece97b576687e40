"""SFTTrainer on the built-in model and task: the loss falls, every weight moves, prompts are masked."""
import dataclasses

import pytest
import torch

from stages.builtin import arithmetic, tiny
from stages.config import ArithmeticConfig
from stages.data.formats import normalise
from stages.losses import IGNORE_INDEX
from stages.trainers.sft import SFTCollator, SFTConfig, SFTTrainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny.build(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4,
                      intermediate_size=128, vocab_size=384, seed=0)
    cfg = ArithmeticConfig(num_train=512, num_preference=10, num_eval=10)
    rows = [normalise("messages", r) for r in arithmetic.generate(**dataclasses.asdict(cfg))["sft"]]
    return path, rows


def _trainer(setup, tmp_path, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, rows = setup
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=32, learning_rate=3e-3,
                     logging_steps=5, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                     seed=0, **kw)
    return SFTTrainer(model, args, processing_class=tok, train_dataset=rows), tok


def test_loss_falls_and_every_parameter_changes(setup, tmp_path):
    trainer, _ = _trainer(setup, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged
    logged = trainer.state.log_history[0]
    assert 0 <= logged["mean_token_accuracy"] <= 1 and logged["num_tokens"] > 0


def test_collator_masks_prompt_and_padding_from_positions():
    """pad id == eos id: the real EOS at the end of the completion must still be a label."""
    eos = pad = 7
    feats = [{"input_ids": [1, 2, 3, 4, eos], "completion_mask": [0, 0, 0, 1, 1]},
             {"input_ids": [1, 5, eos], "completion_mask": [0, 1, 1]}]
    batch = SFTCollator(pad_token_id=pad)(feats)
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3 + [4, eos], [IGNORE_INDEX, 5, eos, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    full = SFTCollator(pad_token_id=pad, completion_only_loss=False)(feats)
    assert full["labels"][1].tolist() == [1, 5, eos, IGNORE_INDEX, IGNORE_INDEX]


def test_completion_tokens_are_the_assistant_answer(setup, tmp_path):
    trainer, tok = _trainer(setup, tmp_path)
    row = trainer.train_dataset[0]
    completion = [i for i, m in zip(row["input_ids"], row["completion_mask"]) if m]
    answer = setup[1][0]["completion"][0]["content"]
    assert tok.decode(completion) == answer + "<|end|>"
