"""Acceptance rules as pure functions, in paper notation: p = target distribution, q = draft distribution.

- greedy (T=0): the longest root-to-node path whose every token equals the target argmax at its parent;
- sampling (T>0): recursive rejection sampling down the tree (SpecInfer; EAGLE's evaluate_posterior): at a node, try
  its children in order; accept child x with probability min(1, p(x)/q(x)); on rejection p := norm(max(p - q, 0))
  before the next sibling. Deterministic children (q = None) are proposals with q = one-hot(x): acceptance p(x),
  residual p with p[x] := 0, renormalised. When every child is rejected the *recovered* token is sampled from the
  residual; after a leaf the *bonus* token is sampled from p. Either way one token more than the accepted path, so
  tau >= 1 and the output distribution is exactly the target's (Leviathan et al., Theorem 3.5 / SpecInfer Thm 4.2).

Everything stays on the device (tensor ops over the whole tree, no per-node host reads): the engine reads the outcome
with one transfer per step. The walk down the tree is expressed per node: node i is *good* when it is the child its
parent's walk accepts (greedy: it matches the argmax; sampling: it is the first accepted child, its acceptance
probability conditioned on its earlier siblings' rejection); the accepted path is the deepest node whose drafted
ancestors are all good. One uniform u_i is drawn per node up front and used only if the walk reaches node i, so the
law is the sequential walk's (the random stream differs from drawing u at each visit, the distribution does not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Acceptance:
    """One verification's outcome, on the device."""

    path: torch.Tensor  # [N] accepted node indices in root-to-leaf order, then -1
    length: torch.Tensor  # [] number of accepted nodes A
    next_token: torch.Tensor  # [] the bonus or recovered token
    recovered: torch.Tensor  # [] bool: a child of the last accepted node was rejected


def row(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-dim index tensor, on the device: indexing with it would read it on the host (ATen's .item())."""
    return x.index_select(0, i.reshape(1)).squeeze(0)


def _deepest_good_path(good: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor):
    """good [N] bool, parents [N], anc [N+1, N+1] -> (path [N], length [], last node [] (-1 = root), recovered [])."""
    n = good.shape[0]
    if n == 0:
        z = parents.new_zeros(())
        return parents.new_empty(0), z, z - 1, torch.zeros((), dtype=torch.bool, device=parents.device)
    anc_nodes = anc[1:, 1:]  # [N, N] drafted ancestors (and itself)
    on_path = ~(anc_nodes & ~good).any(-1)  # [N] the node and every drafted ancestor are good
    depth = torch.where(on_path, anc_nodes.sum(-1), 0)  # [N]
    length = depth.max()
    last = torch.where(length > 0, depth.argmax(), -1)  # argmax: the first of the deepest
    idx = torch.arange(n, device=parents.device)
    on_last = row(anc_nodes, last.clamp(min=0))  # [N] (no root row: masked by length > 0 below)
    path = torch.where(on_last & (length > 0), idx, n).sort().values  # ancestors come first (topological)
    path = torch.where(path < n, path, -1)
    recovered = (parents == last).any()  # the walk stopped below a node that had children: all were rejected
    return path, length, last, recovered


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                  target_argmax: torch.Tensor) -> Acceptance:
    """tokens, parents [N]; anc [N+1, N+1] (specbench.tree.ancestor_matrix); target_argmax [N+1]: argmax of p at row r
    (0 = root, i+1 = node i). The deepest fully-matching path (the first of equals), then the argmax below it."""
    good = tokens == target_argmax[parents + 1]  # [N] the node is the target's choice at its parent
    path, length, last, recovered = _deepest_good_path(good, parents, anc)
    return Acceptance(path, length, row(target_argmax, last + 1), recovered)


def _earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """sib[i, j]: node j is a sibling of node i drafted before it (tried first by the walk). [N, N] bool"""
    n = parents.shape[0]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    return (parents[:, None] == parents[None, :]) & earlier


def _accept_probs_deterministic(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q = one-hot: child i is tried with p_res(x_i), p_res = p at its parent with the earlier siblings' tokens zeroed,
    renormalised: p(x_i) / (sum p - sum over distinct earlier siblings' tokens), or 0 if one of them was x_i. [N]"""
    g = p[parents + 1, tokens]  # [N] p_parent(x_i)
    sib = _earlier_siblings(parents)  # [N, N]
    dup = (sib & (tokens[:, None] == tokens[None, :])).any(-1)  # [N] an earlier sibling drafted the same token
    removed = (sib & ~dup[None, :]).to(p.dtype) @ g  # [N] mass of the distinct tokens already rejected
    mass = p.sum(-1)[parents + 1] - removed
    # mass <= 0 only through float round-off (a token with p(x) = 1 is always accepted): p itself, as before
    return torch.where(dup, 0.0, torch.where(mass > 0, g / mass.clamp(min=1e-30), g))


def _walk_sampled(tokens, parents, p, q, u):
    """Draft children sampled from q (SpecInfer's siblings): the residual after a rejection depends on q, so the walk
    runs in node order, which is the order it visits nodes in (a later sibling or a child always has a larger index);
    state stays on the device. Returns good [N] and the row distribution the walk ends with [V]."""
    cur = parents.new_full((), -1)  # the last accepted node (-1 = root)
    p_row = p[0]
    good = torch.zeros_like(tokens, dtype=torch.bool)
    for i in range(tokens.shape[0]):
        here = parents[i] == cur  # the walk tries node i now
        x = tokens[i : i + 1]  # [1]: gathered, not used as a Python scalar index
        qx, px = q[i].gather(0, x)[0], p_row.gather(0, x)[0]
        take = here & (u[i] < torch.where(qx > 0, torch.clamp(px / qx.clamp(min=1e-30), max=1.0), 1.0))
        residual = torch.clamp(p_row - q[i], min=0.0)
        total = residual.sum()
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), row(p, cur + 1))  # round-off: p itself
        p_row = torch.where(take, p[i + 1], torch.where(here, residual, p_row))
        cur = torch.where(take, i, cur)
        good[i] = take
    return good, p_row


def rejection_accept(
    tokens: torch.Tensor,  # [N]
    parents: torch.Tensor,  # [N]
    anc: torch.Tensor,  # [N+1, N+1]
    p: torch.Tensor,  # [N+1, V] target probabilities per row (0 = root, i+1 = node i)
    q: torch.Tensor | None,  # [N, V] the draft distribution node i was sampled from; None = deterministic
    generator: torch.Generator | None,
) -> Acceptance:
    n = tokens.shape[0]
    # u_i: node i's acceptance draw, used if the walk reaches node i
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    if q is None:
        accept = u < _accept_probs_deterministic(tokens, parents, p)
        good = accept & ~(_earlier_siblings(parents) & accept[None, :]).any(-1)  # its parent's first accepted child
        path, length, last, recovered = _deepest_good_path(good, parents, anc)
        p_row = row(p, last + 1)
        kill = torch.zeros(p.shape[-1] + 1, dtype=torch.bool, device=p.device)
        kill[torch.where(parents == last, tokens, p.shape[-1])] = True  # the rejected children's tokens (none: leaf)
        residual = p_row.masked_fill(kill[:-1], 0.0)
        total = residual.sum()
        p_row = torch.where(total > 0, residual / total.clamp(min=1e-30), p_row)
    else:
        good, p_row = _walk_sampled(tokens, parents, p, q, u)
        path, length, last, recovered = _deepest_good_path(good, parents, anc)
    return Acceptance(path, length, torch.multinomial(p_row, 1, generator=generator)[0], recovered)
