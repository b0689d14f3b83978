"""The pieces every distillation loss shares: the target's next-token law from its own last hidden states as soft
labels, cross-entropy / KL to it, and top-1 agreement (the training-time proxy for greedy acceptance)."""
from __future__ import annotations

import torch


@torch.no_grad()
def teacher_probs(target, hidden: torch.Tensor) -> torch.Tensor:
    """p = softmax(LMHead(h)) of the frozen target: [N, H] -> [N, V] float32."""
    return target.lm_head(hidden.to(target.dtype)).float().softmax(-1)


def soft_ce(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_v p log q (EAGLE's classification loss); KL(p || q) minus p's entropy, same gradient."""
    return -(p * logq).sum(-1).mean()


def kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p || q) = sum_v p (log p - log q); p = 0 terms count 0."""
    return (p * (p.clamp_min(1e-30).log() - logq)).sum(-1).mean()


def per_sequence_weights(rows: torch.Tensor) -> torch.Tensor:
    """Weights over the selected positions rows [B, T] (bool) -> [M] (M = rows.sum()), each of the n_b positions of
    sequence b weighing 1 / (n_b x the sequences with any): the mean of each sequence's mean, as a trainer that takes
    one sequence per micro-batch and accumulates weighs them (MoA's authors, `mini_batch_size: 1`), except that a
    sequence without answer tokens is left out here where theirs counts it at ~0 in the mean."""
    n = rows.sum(1)  # [B]
    per_row = torch.where(n > 0, 1.0 / (n.clamp(min=1) * (n > 0).sum()), torch.zeros((), device=rows.device))
    return per_row[:, None].expand_as(rows)[rows].float()


def weighted_mean(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """x [M] -> sum w x (w [M] summing to 1), or x's plain mean where w is None."""
    return x.mean() if w is None else (x * w).sum()


@torch.no_grad()
def top1(logq: torch.Tensor, p: torch.Tensor) -> float:
    """Fraction of rows whose argmax agrees."""
    return (logq.argmax(-1) == p.argmax(-1)).float().mean().item()
