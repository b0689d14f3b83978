"""Acceptance rules as pure functions, in paper notation: p = target distribution, q = draft distribution.

- greedy (T=0): the longest root-to-node path whose every token equals the target argmax at its parent;
- sampling (T>0): recursive rejection sampling down the tree (SpecInfer; EAGLE's evaluate_posterior): at a node, try
  its children in order; accept child x with probability min(1, p(x)/q(x)); on rejection p := norm(max(p - q, 0))
  before the next sibling. Deterministic children (q = None) are proposals with q = one-hot(x): acceptance p(x),
  residual p with p[x] := 0, renormalised. When every child is rejected the *recovered* token is sampled from the
  residual; after a leaf the *bonus* token is sampled from p. Either way one token more than the accepted path, so
  tau >= 1 and the output distribution is exactly the target's (Leviathan et al., Theorem 3.5 / SpecInfer Thm 4.2).

Everything stays on the device (tensor ops over the whole tree, no per-node host reads): the engine reads the outcome
with one transfer per step. Every rule is written over the rows of a batch (`*_rows`: trees padded to one node count,
`valid` [A, N] marking the real nodes); the one-tree forms are the rows forms at one row, so batch 1 and batch B
decide with the same ops. The walk down the tree is expressed per node: node i is *good* when it is the child its
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
    """One verification's outcome, on the device: per row of the batch (`*_rows`, leading [A]) or of one tree."""

    path: torch.Tensor  # [A, N] accepted node indices in root-to-leaf order, then -1
    length: torch.Tensor  # [A] number of accepted nodes
    next_token: torch.Tensor  # [A] the bonus or recovered token
    recovered: torch.Tensor  # [A] bool: a child of the last accepted node was rejected

    def row(self, r: int) -> "Acceptance":
        return Acceptance(self.path[r], self.length[r], self.next_token[r], self.recovered[r])


def row(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-dim index tensor, on the device: indexing with it would read it on the host (ATen's .item())."""
    return x.index_select(0, i.reshape(1)).squeeze(0)


def rows_at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[a, i[a]] for every row a, on the device. x [A, M, ...], i [A] -> [A, ...]."""
    idx = i.reshape(-1, *([1] * (x.dim() - 1))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, idx).squeeze(1)


def _deepest_good_path(good: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, valid: torch.Tensor | None):
    """good, parents [A, N], anc [A, N+1, N+1], valid [A, N] (None: every node real) -> (path [A, N], length [A],
    last node [A] (-1 = root), recovered [A])."""
    a, n = good.shape
    if n == 0:
        z = parents.new_zeros(a)
        return parents.new_empty(a, 0), z, z - 1, torch.zeros(a, dtype=torch.bool, device=parents.device)
    if valid is not None:
        good = good & valid  # a padding node is never accepted
    anc_nodes = anc[:, 1:, 1:]  # [A, N, N] drafted ancestors (and itself)
    on_path = ~(anc_nodes & ~good[:, None, :]).any(-1)  # [A, N] the node and every drafted ancestor are good
    depth = torch.where(on_path, anc_nodes.sum(-1), 0)  # [A, N]
    length = depth.max(-1).values
    last = torch.where(length > 0, depth.argmax(-1), -1)  # argmax: the first of the deepest
    idx = torch.arange(n, device=parents.device)
    on_last = rows_at(anc_nodes, last.clamp(min=0))  # [A, N] (no root row: masked by length > 0 below)
    path = torch.where(on_last & (length > 0)[:, None], idx, n).sort(-1).values  # ancestors first (topological)
    path = torch.where(path < n, path, -1)
    below = parents == last[:, None]  # the walk stopped below a node that had children: all were rejected
    recovered = (below if valid is None else below & valid).any(-1)
    return path, length, last, recovered


def greedy_accept_rows(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, target_argmax: torch.Tensor,
                       valid: torch.Tensor | None = None) -> Acceptance:
    """tokens, parents [A, N]; anc [A, N+1, N+1] (specbench.tree.ancestor_matrices); target_argmax [A, N+1]: argmax
    of p at row r (0 = root, i+1 = node i); valid [A, N] (None: no padding). Per row: the deepest fully-matching path
    (the first of equals), then the argmax below it."""
    good = tokens == target_argmax.gather(1, parents + 1)  # [A, N] the node is the target's choice at its parent
    path, length, last, recovered = _deepest_good_path(good, parents, anc, valid)
    return Acceptance(path, length, target_argmax.gather(1, (last + 1)[:, None])[:, 0], recovered)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                  target_argmax: torch.Tensor) -> Acceptance:
    """One tree: tokens, parents [N]; anc [N+1, N+1]; target_argmax [N+1] (greedy_accept_rows at one row)."""
    return greedy_accept_rows(tokens[None], parents[None], anc[None], target_argmax[None]).row(0)


def _earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """sib[a, i, j]: node j is a sibling of node i drafted before it (tried first by the walk). [A, N, N] bool"""
    n = parents.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    return (parents[:, :, None] == parents[:, None, :]) & earlier


def _accept_probs_deterministic(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q = one-hot: child i is tried with p_res(x_i), p_res = p at its parent with the earlier siblings' tokens zeroed,
    renormalised: p(x_i) / (sum p - sum over distinct earlier siblings' tokens), or 0 if one of them was x_i. [A, N]"""
    g = p.gather(1, (parents + 1)[:, :, None].expand(-1, -1, p.shape[-1])).gather(2, tokens[:, :, None])[..., 0]
    sib = _earlier_siblings(parents)  # [A, N, N]
    dup = (sib & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [A, N] an earlier sibling drafted x_i too
    removed = ((sib & ~dup[:, None, :]).to(p.dtype) @ g[:, :, None])[..., 0]  # [A, N] mass of distinct rejected
    mass = p.sum(-1).gather(1, parents + 1) - removed
    # mass <= 0 only through float round-off (a token with p(x) = 1 is always accepted): p itself, as before
    return torch.where(dup, 0.0, torch.where(mass > 0, g / mass.clamp(min=1e-30), g))


def _walk_sampled(tokens, parents, p, q, u, valid):
    """Draft children sampled from q (SpecInfer's siblings): the residual after a rejection depends on q, so the walk
    runs in node order, which is the order it visits nodes in (a later sibling or a child always has a larger index),
    every row at once; state stays on the device. Returns good [A, N] and the row distribution each walk ends with
    [A, V]."""
    a, n = tokens.shape
    cur = parents.new_full((a,), -1)  # the last accepted node per row (-1 = root)
    p_row = p[:, 0]  # [A, V]
    good = torch.zeros_like(tokens, dtype=torch.bool)
    for i in range(n):
        here = parents[:, i] == cur  # [A] the walk tries node i now
        if valid is not None:
            here = here & valid[:, i]
        x = tokens[:, i : i + 1]  # [A, 1]: gathered, not used as a Python scalar index
        qx, px = q[:, i].gather(1, x)[:, 0], p_row.gather(1, x)[:, 0]
        take = here & (u[:, i] < torch.where(qx > 0, torch.clamp(px / qx.clamp(min=1e-30), max=1.0), 1.0))
        residual = torch.clamp(p_row - q[:, i], min=0.0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), rows_at(p, cur + 1))  # round-off: p
        p_row = torch.where(take[:, None], p[:, i + 1], torch.where(here[:, None], residual, p_row))
        cur = torch.where(take, i, cur)
        good[:, i] = take
    return good, p_row


def rejection_accept_rows(
    tokens: torch.Tensor,  # [A, N]
    parents: torch.Tensor,  # [A, N]
    anc: torch.Tensor,  # [A, N+1, N+1]
    p: torch.Tensor,  # [A, N+1, V] target probabilities per row (0 = root, i+1 = node i)
    q: torch.Tensor | None,  # [A, N, V] the draft distribution node i was sampled from; None = deterministic
    generators: list[torch.Generator | None],  # [A] each row's RNG
    sizes: list[int] | None = None,  # [A] real nodes per row (None: N each)
    valid: torch.Tensor | None = None,  # [A, N] the same on the device
) -> Acceptance:
    a, n = tokens.shape
    sizes = sizes if sizes is not None else [n] * a
    # u_i: node i's acceptance draw, used if the walk reaches node i; each row draws its own nodes' from its own RNG
    # (a row's stream is what it draws alone); padding nodes get 1 (never accepted, and masked out as well)
    draws = [torch.rand(k, generator=g, device=p.device, dtype=p.dtype) for k, g in zip(sizes, generators)]
    u = draws[0][None] if a == 1 and sizes[0] == n else torch.stack(
        [torch.cat([d, d.new_ones(n - d.shape[0])]) for d in draws])  # [A, N]
    if q is None:
        accept = u < _accept_probs_deterministic(tokens, parents, p)
        good = accept & ~(_earlier_siblings(parents) & accept[:, None, :]).any(-1)  # its parent's first accepted child
        path, length, last, recovered = _deepest_good_path(good, parents, anc, valid)
        p_row = rows_at(p, last + 1)  # [A, V]
        v = p.shape[-1]
        kids = parents == last[:, None]
        if valid is not None:
            kids = kids & valid
        kill = torch.zeros(a, v + 1, dtype=torch.bool, device=p.device)
        kill.scatter_(1, torch.where(kids, tokens, v), True)  # the rejected children's tokens (none below a leaf)
        residual = p_row.masked_fill(kill[:, :-1], 0.0)
        total = residual.sum(-1, keepdim=True)
        p_row = torch.where(total > 0, residual / total.clamp(min=1e-30), p_row)
    else:
        good, p_row = _walk_sampled(tokens, parents, p, q, u, valid)
        path, length, last, recovered = _deepest_good_path(good, parents, anc, valid)
    nxt = torch.cat([torch.multinomial(p_row[r], 1, generator=g) for r, g in enumerate(generators)])
    return Acceptance(path, length, nxt, recovered)


def rejection_accept(
    tokens: torch.Tensor,  # [N]
    parents: torch.Tensor,  # [N]
    anc: torch.Tensor,  # [N+1, N+1]
    p: torch.Tensor,  # [N+1, V]
    q: torch.Tensor | None,  # [N, V]; None = deterministic
    generator: torch.Generator | None,
) -> Acceptance:
    """One tree (rejection_accept_rows at one row)."""
    return rejection_accept_rows(tokens[None], parents[None], anc[None], p[None], None if q is None else q[None],
                                 [generator]).row(0)
