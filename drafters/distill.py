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


@torch.no_grad()
def top1(logq: torch.Tensor, p: torch.Tensor) -> float:
    """Fraction of rows whose argmax agrees."""
    return (logq.argmax(-1) == p.argmax(-1)).float().mean().item()
