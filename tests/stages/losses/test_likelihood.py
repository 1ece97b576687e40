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


def test_dft_weights_each_token_loss_by_its_probability():
    """V = 2 and logits (0, log 3) at both positions: p(token 1) = 3/4, p(token 0) = 1/4. Targets 1 then 0:
    nll per token log(4/3) and log 4; dft multiplies each by its (constant) probability:
    (3/4·log(4/3) + 1/4·log 4) / 2."""
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)], [0.0, 0.0]]])
    labels = torch.tensor([[IGNORE_INDEX, 1, 0]])
    nll, _ = sft_loss(logits, labels)
    dft, stats = sft_loss(logits, labels, loss_type="dft")
    assert math.isclose(nll.item(), (math.log(4 / 3) + math.log(4)) / 2, rel_tol=1e-6)
    assert math.isclose(dft.item(), (0.75 * math.log(4 / 3) + 0.25 * math.log(4)) / 2, rel_tol=1e-6)
    assert stats["num_tokens"].item() == 2


def test_dft_gradient_holds_the_weight_constant():
    """d/dlogp [-logp · stop_grad(p)] = -p: the gradient of each token's log-prob is its probability."""
    from stages.losses import sft_loss_from_logps

    logps = torch.log(torch.tensor([0.75, 0.25])).requires_grad_()
    sft_loss_from_logps(logps, loss_type="dft").backward()
    assert torch.allclose(logps.grad, torch.tensor([-0.75, -0.25]) / 2)


def test_chunked_and_full_logits_dft_agree():
    from stages.losses import sft_loss_from_logps

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, -100, 5, 6]])
    full, _ = sft_loss(logits, labels, loss_type="dft")
    targets, select = labels[:, 1:], labels[:, 1:] != -100
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0][select]
    assert torch.allclose(full, sft_loss_from_logps(logps, loss_type="dft"), atol=1e-6)


def test_unknown_sft_loss_type_is_named():
    import pytest

    with pytest.raises(ValueError, match="sft.loss_type = 'dpo': expected one of nll, dft"):
        sft_loss(torch.zeros(1, 2, 3), torch.tensor([[0, 1]]), loss_type="dpo")


def test_token_counts_score_each_position_against_the_next_label():
    """logits (1, 4, 3): position t predicts labels[t + 1]; labels [_, 2, X, 0] -> positions 0 and 2 count; their
    argmaxes are 2 (right) and 1 (wrong): 2 tokens, 1 correct. The last position predicts nothing."""
    from stages.losses import token_counts

    logits = torch.tensor([[[0.0, 0.0, 5.0], [9.0, 0.0, 0.0], [0.0, 3.0, 0.0], [7.0, 0.0, 0.0]]])
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 0]])
    counts = token_counts(logits, labels)
    assert (counts["num_tokens"].item(), counts["correct_tokens"].item()) == (2, 1)
