"""LD-DPO's weighted sums and WPO's pair weights (stages.losses.pair_length) on hand-made tensors."""
from __future__ import annotations

import math

import pytest
import torch

from stages.losses.pair_length import ld_logps, log_sum_sq_probs, wpo_weights

# One pair: the chosen row's completion is 3 tokens (positions 1-3), the rejected row's 2 (positions 0-1).
PER_TOKEN = torch.tensor([[0.0, -1.0, -2.0, -3.0],
                          [-0.5, -1.5, 0.0, 0.0]])
MASK = torch.tensor([[0, 1, 1, 1],
                     [1, 1, 0, 0]])


@pytest.mark.parametrize(("alpha", "expected"), [(1.0, [-6.0, -2.0]), (0.5, [-4.5, -2.0]), (0.0, [-3.0, -2.0])])
def test_ld_logps_scales_the_tail_past_the_shared_length(alpha, expected):
    """Shared length ℓ = min(3, 2) = 2. Chosen: -1 + -2 (its tokens 1-2) + α·(-3) (its token 3, past ℓ):
    α=1: -6 (the plain sum), α=0.5: -4.5, α=0: -3. Rejected: -0.5 + -1.5 = -2, nothing past ℓ."""
    assert ld_logps(PER_TOKEN, MASK, alpha).tolist() == expected


def test_ld_logps_pairs_each_chosen_with_its_own_rejected():
    """Two pairs (rows c1, c2, r1, r2). Pair 1: c1 3 tokens, r1 1 token -> ℓ=1: c1 = -1 + α(-1 - 1),
    r1 = -2. Pair 2: c2 1 token, r2 2 tokens -> ℓ=1: c2 = -4, r2 = -1 + α(-3). With α = 0.25:
    c1 = -1.5, c2 = -4, r1 = -2, r2 = -1.75."""
    per_token = torch.tensor([[-1.0, -1.0, -1.0], [-4.0, 0.0, 0.0], [-2.0, 0.0, 0.0], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    assert ld_logps(per_token, mask, 0.25).tolist() == [-1.5, -4.0, -2.0, -1.75]


def test_ld_logps_keeps_the_gradient():
    per_token = PER_TOKEN.clone().requires_grad_()
    ld_logps(per_token, MASK, 0.5).sum().backward()
    assert per_token.grad.tolist() == [[0.0, 1.0, 1.0, 0.5], [1.0, 1.0, 0.0, 0.0]]


def test_ld_logps_refuses_an_odd_number_of_rows():
    with pytest.raises(ValueError, match="B chosen rows, then B rejected"):
        ld_logps(PER_TOKEN[:1], MASK[:1], 0.5)


def test_log_sum_sq_probs():
    """logits [0, ln 3] -> p = [1/4, 3/4], Σp² = 1/16 + 9/16 = 5/8; logits [0, 0] -> Σp² = 1/2."""
    out = log_sum_sq_probs(torch.tensor([[0.0, math.log(3)], [0.0, 0.0]]))
    assert torch.allclose(out, torch.tensor([math.log(5 / 8), math.log(1 / 2)]))


def test_wpo_weights_by_hand():
    """Chosen: two tokens from p = [1/4, 3/4] (Σp² = 5/8), taking token 1 then token 0:
    aligned log-probs ln(3/4 / 5/8) = ln 1.2 and ln(1/4 / 5/8) = ln 0.4; mean = ln(0.48)/2, weight √0.48.
    Rejected: one token from p = [1/2, 1/2] (Σp² = 1/2): ln(1/2) - ln(1/2) = 0, weight 1 (its padding
    position, with made-up values, is masked). Pair weight: √0.48 · 1 = 0.6928203..."""
    lp = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.3]]))
    sq = torch.log(torch.tensor([[0.625, 0.625], [0.5, 0.9]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    out = wpo_weights(lp, sq, mask)
    assert out.shape == (1,)
    assert math.isclose(out.item(), math.sqrt(0.48), rel_tol=1e-6)


def test_wpo_weights_are_detached():
    lp = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.3]])).requires_grad_()
    assert not wpo_weights(lp, lp.detach() * 0, torch.ones(2, 2)).requires_grad
