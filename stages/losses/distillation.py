"""On-policy distillation: the generalized Jensen-Shannon divergence between student and teacher.

Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(ICLR 2024). The student samples completions; at every completion position both models give a
next-token distribution over the shared vocabulary, and the student is trained to match the
teacher's. `beta` picks the divergence: 1 the reverse KL(student || teacher) (mode-seeking: the
student puts no mass where the teacher has none), 0 the forward KL(teacher || student), in between
the generalized JSD with the mixture m = (1 - beta)·p_student + beta·p_teacher.
"""
from __future__ import annotations

import math

import torch

from stages.losses.numerics import _check_shapes, _upcast


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence between softmax(student_logits / T) and softmax(teacher_logits / T).

    student_logits, teacher_logits: (N, V), one row per completion position, the same vocabulary.
    With p_s, p_t those distributions and m = (1 - β) p_s + β p_t:

      β = 0   KL(p_t || p_s) = Σ p_t (log p_t - log p_s)
      β = 1   KL(p_s || p_t) = Σ p_s (log p_s - log p_t)
      else    β KL(p_t || m) + (1 - β) KL(p_s || m)

    Returns (N,) in float32 (or float64 for float64 inputs); the gradient reaches whichever input requires it
    (the student's in training).
    """
    _check_shapes(student_logits.shape, "student_logits", teacher_logits=teacher_logits)
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits has shape {tuple(student_logits.shape)}: expected (N, V), one row per "
                         "completion position")
    if not 0 <= beta <= 1:
        raise ValueError(f"beta = {beta}: must be in [0, 1] (0 forward KL, 1 reverse KL, between: generalized JSD)")
    if not temperature > 0:
        raise ValueError(f"temperature = {temperature}: must be > 0")
    log_s = torch.log_softmax(_upcast(student_logits) / temperature, dim=-1)
    log_t = torch.log_softmax(_upcast(teacher_logits) / temperature, dim=-1)
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
    return (beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)).sum(-1)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 1.0,
                      temperature: float = 1.0, num_items_in_batch: int | torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation loss over N completion positions (only the positions that count: masking is the caller's).

    student_logits, teacher_logits: (N, V). loss = Σ_n generalized_jsd_n / D, with D = num_items_in_batch
    (the whole optimizer step's positions, so micro-batches sum to the step's mean) or N.
    Metrics (detached): "entropy", the student's mean entropy at temperature T; "divergence", the mean
    per-position divergence of this batch.
    """
    per_position = generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)
    n = per_position.shape[0]
    denominator = num_items_in_batch if num_items_in_batch is not None else max(n, 1)
    loss = per_position.sum() / denominator
    with torch.no_grad():
        log_s = torch.log_softmax(_upcast(student_logits.detach()) / temperature, dim=-1)
        entropy = -(log_s.exp() * log_s).sum(-1)
        metrics = {"entropy": entropy.sum() / max(n, 1), "divergence": per_position.detach().sum() / max(n, 1)}
    return loss, metrics
