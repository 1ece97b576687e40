"""RLOO's leave-one-out advantages and sequence-level clipped loss: hand-derived values, then TRL 1.16's loss."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from stages.losses import rloo_advantages, rloo_loss


def test_leave_one_out_baseline_by_hand():
    """G = 3, rewards (3, 0, 0): A_0 = 3 - (0 + 0)/2 = 3, A_1 = A_2 = 0 - (3 + 0)/2 = -1.5.
    G = 2, rewards (1, 0 | 0, 2): each baseline is the sibling, A = (1, -1 | -2, 2)."""
    assert rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3).tolist() == [3.0, -1.5, -1.5]
    assert rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), 2).tolist() == [1.0, -1.0, -2.0, 2.0]


def test_unscored_completions_leave_the_baseline_and_get_zero():
    """(3, 0, unscored): the baseline counts the 2 scored ones, A = (3 - 0, 0 - 3, 0). A group with a single scored
    completion has no one to compare with: A = 0 throughout."""
    valid = torch.tensor([True, True, False, True, False, False])
    got = rloo_advantages(torch.tensor([3.0, 0.0, math.nan, 5.0, math.nan, math.nan]), 3, valid=valid)
    assert got.tolist() == [3.0, -3.0, 0.0, 0.0, 0.0, 0.0]


def test_kl_penalty_enters_the_reward_before_the_baseline():
    """rewards (1, 1), summed log-ratios (2, 0), beta 0.5: r = (1 - 1, 1 - 0) = (0, 1), A = (-1, 1)."""
    got = rloo_advantages(torch.tensor([1.0, 1.0]), 2, kl=torch.tensor([2.0, 0.0]), beta=0.5)
    assert got.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="beta = 0.5 but kl is None"):
        rloo_advantages(torch.tensor([1.0, 1.0]), 2, beta=0.5)


def test_reward_clip_and_normalisation():
    """Clip (0, 1): (3, 0, 0) -> (1, 0, 0), A = (1, -0.5, -0.5). Normalised: mean 0, unbiased std
    sqrt((1 + 0.25 + 0.25) / 2) = sqrt(0.75), so A / (sqrt(0.75) + 1e-4)."""
    clipped = rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, reward_clip_range=(0.0, 1.0))
    assert clipped.tolist() == [1.0, -0.5, -0.5]
    normed = rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, reward_clip_range=(0.0, 1.0), normalize=True)
    expected = torch.tensor([1.0, -0.5, -0.5]) / (math.sqrt(0.75) + 1e-4)
    torch.testing.assert_close(normed, expected)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="not divisible by num_generations = 2"):
        rloo_advantages(torch.zeros(3), 2)
    with pytest.raises(ValueError, match="num_generations = 1: must be >= 2"):
        rloo_advantages(torch.zeros(2), 1)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        rloo_loss(torch.zeros(2, 2), None, torch.zeros(3), torch.ones(2, 2))


def _loss_batch():
    """Two completions of two tokens; row 1's second token is padding. Sequence log-probs s = (-1, -2).
    old s = (-1 - ln 2, -2 + ln 2): ratios (2, 0.5), both advantages +1, eps 0.2:
    row 0: min(2, 1.2) = 1.2 (clipped above); row 1: min(0.5, 0.8) = 0.5 (unclipped).
    loss = -(1.2 + 0.5) / 2 = -0.85. Gradient: row 0 clipped, 0; row 1 -d(ρ)/ds / 2 = -0.5 / 2 = -0.25
    on its one real token."""
    logps = torch.tensor([[-0.5, -0.5], [-2.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.tensor([[-0.5 - math.log(2), -0.5], [-2.0 + math.log(2), -9.0]])
    return logps, old, torch.tensor([1.0, 1.0]), mask


def test_sequence_ratio_is_clipped_by_hand():
    logps, old, adv, mask = _loss_batch()
    loss, metrics = rloo_loss(logps, old, adv, mask, epsilon_low=0.2)
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0], [-0.25, 0.0]]))
    assert metrics["clip_ratio/high_mean"].item() == 0.5 and metrics["clip_ratio/low_mean"].item() == 0.0


def test_on_policy_loss_is_reinforce():
    """old_logps None: ρ = 1 with gradient A_i / B per token, loss -mean(A) = -(2 - 1) / 2."""
    logps = torch.tensor([[-1.0, -1.0], [-3.0, -1.0]], requires_grad=True)
    loss, _ = rloo_loss(logps, None, torch.tensor([2.0, -1.0]), torch.ones(2, 2))
    assert loss.item() == -0.5
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0], [0.5, 0.5]]))


def test_same_batch_as_trls_rloo_loss():
    """TRL 1.16's RLOOTrainer._compute_loss on the same per-token log-probs, old log-probs, advantages and mask
    (TRL's method run on a stand-in `self` that hands it these log-probs instead of a model's)."""
    trl = pytest.importorskip("trl")
    from accelerate import Accelerator

    torch.manual_seed(0)
    B, C = 6, 5
    logps = (-torch.rand(B, C) * 3).requires_grad_(True)
    old = logps.detach() + 0.4 * torch.randn(B, C)
    mask = (torch.arange(C)[None] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).long()
    adv = torch.randn(B)
    ours, _ = rloo_loss(logps, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28)
    grad_ours, = torch.autograd.grad(ours, logps)

    logps2 = logps.detach().clone().requires_grad_(True)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps2, torch.zeros(B, C), None),
        aux_loss_enabled=False, epsilon_low=0.2, epsilon_high=0.28, model=torch.nn.Linear(1, 1),
        accelerator=Accelerator(cpu=True), _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": mask,
              "old_logps": (old * mask).sum(1), "advantages": adv}
    theirs = trl.RLOOTrainer._compute_loss(stand_in, None, inputs)
    grad_theirs, = torch.autograd.grad(theirs, logps2)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)
