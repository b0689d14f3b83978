"""Acceptance rules as pure functions, in paper notation: p = target distribution, q = draft distribution.

- greedy (T=0): the longest root-to-node path whose every token equals the target argmax at its parent;
- sampling (T>0): recursive rejection sampling down the tree (SpecInfer; EAGLE's evaluate_posterior): at a node, try
  its children in order; accept child x with probability min(1, p(x)/q(x)); on rejection p := norm(max(p - q, 0))
  before the next sibling. Deterministic children (q = None) are proposals with q = one-hot(x): acceptance p(x),
  residual p with p[x] := 0, renormalised. When every child is rejected the *recovered* token is sampled from the
  residual; after a leaf the *bonus* token is sampled from p. Either way one token more than the accepted path, so
  tau >= 1 and the output distribution is exactly the target's (Leviathan et al., Theorem 3.5 / SpecInfer Thm 4.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.tree import children_lists


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root-to-leaf order
    next_token: int  # bonus or recovered token
    recovered: bool  # a child of the last accepted node was rejected


def greedy_accept(tokens: list[int], parents: list[int], target_argmax: list[int]) -> Acceptance:
    """target_argmax[r]: argmax of p at row r (0 = root, i+1 = node i). Returns the deepest fully-matching path."""
    ok = [False] * len(tokens)  # ok[i]: node i and all its ancestors match the target
    best, best_depth, depth = -1, 0, [0] * len(tokens)
    for i, (x, par) in enumerate(zip(tokens, parents)):
        if (par < 0 or ok[par]) and x == target_argmax[par + 1]:
            ok[i] = True
            depth[i] = 1 + (depth[par] if par >= 0 else 0)
            if depth[i] > best_depth:
                best, best_depth = i, depth[i]
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    has_children = any(par == best for par in parents)
    return Acceptance(path=path, next_token=target_argmax[best + 1], recovered=has_children)


def rejection_accept(
    tokens: list[int],
    parents: list[int],
    p: torch.Tensor,  # [N+1, V] target probabilities per row (0 = root, i+1 = node i)
    q: torch.Tensor | None,  # [N, V] the draft distribution node i was sampled from; None = deterministic
    generator: torch.Generator | None,
) -> Acceptance:
    kids = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        p_row = p[row]
        recovered = False
        for child in kids[row]:
            x = tokens[child]
            u = torch.rand((), generator=generator, device=p.device).item()
            if q is None:
                accept_prob = p_row[x].item()
            else:
                qx = q[child, x].item()
                accept_prob = 1.0 if qx <= 0.0 else min(1.0, p_row[x].item() / qx)
            if u < accept_prob:
                path.append(child)
                row = child + 1
                break
            # residual for the next sibling (or the recovered token)
            if q is None:
                p_row = p_row.clone()
                p_row[x] = 0.0
            else:
                p_row = torch.clamp(p_row - q[child], min=0.0)
            total = p_row.sum()
            # only reachable through float round-off (a child with p(x) = 1 is always accepted)
            p_row = p_row / total if total > 0 else p[row]
            recovered = True
        else:
            nxt = torch.multinomial(p_row, 1, generator=generator).item()
            return Acceptance(path=path, next_token=int(nxt), recovered=recovered)
