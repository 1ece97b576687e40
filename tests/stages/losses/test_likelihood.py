import math

import torch

from stages.losses import IGNORE_INDEX, sft_loss


def test_sft_loss_hand_computed():
    """Uniform logits over V=4: every labelled token costs log 4; position t predicts labels[t+1]."""
    logits = torch.zeros(1, 4, 4)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 3]])  # two labelled targets
    loss, stats = sft_loss(logits, labels)
    assert math.isclose(loss.item(), math.log(4), rel_tol=1e-6)
    assert stats["num_tokens"].item() == 2


def test_sft_loss_only_counts_labelled_positions():
    logits = torch.full((1, 3, 3), -10.0)
    logits[0, 0, 1] = 10.0  # predicts token 1 at position 1: right
    logits[0, 1, 0] = 10.0  # predicts token 0 at position 2, which is not labelled: irrelevant
    labels = torch.tensor([[IGNORE_INDEX, 1, IGNORE_INDEX]])
    loss, stats = sft_loss(logits, labels)
    assert loss.item() < 1e-6 and stats["correct_tokens"].item() == 1 and stats["num_tokens"].item() == 1


def test_sft_loss_global_denominator_makes_accumulation_exact():
    """Two micro-batches with different token counts: summing their losses over a global count = one big batch."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, -100, 5, 6]])
    full, _ = sft_loss(logits, labels)
    total = (labels[:, 1:] != -100).sum()
    parts = sum(sft_loss(logits[i:i + 1], labels[i:i + 1], num_items_in_batch=total)[0] for i in range(2))
    assert torch.allclose(full, parts, atol=1e-6)
