"""Draft-tree geometry and every attention mask the project builds, in one convention.

The convention: a mask is boolean, `allowed[..., q, k]` True where query row q may attend to key column k, shaped
[B or 1, 1, Q, K] for attention. `additive` turns it into the form HF modules take (0 where allowed, the dtype's
minimum elsewhere). Every row must allow at least one key.

Decoding (trees): row 0 of every tree forward is the root (the last verified token); rows 1..N are the drafted nodes.
Node i sees the cached prefix, the root, its ancestors and itself (SpecInfer / Medusa / EAGLE tree attention):
`ancestor_matrices` (and one tree's `ancestor_matrix`), `visible`, `tree_attention_mask`, `tree_position_ids`.
Training (what a query would see while drafting, simulated over a whole sequence):
`harmonized` (HASS's aligned steps), `up_to_start` and `in_block` (Beagle's windows, MoA's T-step-bounded blocks).

The forward's geometry is computed on the device from the parents tensor (no host transfer, no per-node Python);
`node_depths` / `is_chain` are host-side versions over a read tree (the cost model's; the engine's counters come
from the device, specbench/decode/outcome.py).
"""
from __future__ import annotations

import torch


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node: children of the root have depth 1."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree not in topological order: parents[{i}] = {p}")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def is_chain(parents: list[int]) -> bool:
    """A chain can use the model's own causal mask: no explicit 4D mask is needed."""
    return all(p == i - 1 for i, p in enumerate(parents))


def ancestor_matrices(parents: torch.Tensor) -> torch.Tensor:
    """anc[a, r, c] = True when row c of tree a is row r or one of its ancestors (row 0 = root, row i+1 = node i).
    parents [A, N] (-1 = the root; a padding node is a child of the root) -> [A, N+1, N+1] bool, on parents' device.

    Pointer doubling: after j rounds anc[r] holds r's ancestors less than 2^j levels up and up[r] is its 2^j-th
    ancestor (the root being its own parent), so ceil(log2(N+1)) rounds of tensor ops cover any depth <= N, for every
    tree of the batch at once."""
    a, n = parents.shape
    up = torch.cat([parents.new_zeros(a, 1), parents + 1], 1)  # [A, N+1] parent row of every row
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device).expand(a, n + 1, n + 1)
    for _ in range(n.bit_length()):
        anc = anc | anc.gather(1, up[:, :, None].expand(a, n + 1, n + 1))
        up = up.gather(1, up)
    return anc


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """One tree's: parents [N] -> [N+1, N+1] (ancestor_matrices at one row)."""
    return ancestor_matrices(parents[None])[0]


def visible(seen: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Rows that see a cached prefix of prefix_len entries and the later columns `seen` marks.
    seen [R, S] bool -> [1, 1, R, prefix+S] bool (True = may attend), for attention that takes a boolean mask."""
    prefix = torch.ones(seen.shape[0], prefix_len, dtype=torch.bool, device=seen.device)
    return torch.cat([prefix, seen], -1)[None, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean mask (what HF attention takes): 0 where allowed, dtype-min elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_attention_mask(seen: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of `visible`. [1, 1, R, prefix+S]
    The target's tree forward passes its ancestor matrix (ancestor_matrix, [N+1, N+1]); a drafter growing a tree in
    its own cache passes which drafted slots each new row sees (drafters/trees.py GrowingTree)."""
    return additive(visible(seen, prefix_len), dtype)


def harmonized(length: int, steps: int, device) -> torch.Tensor:
    """HASS's aligned steps as one forward over the concatenated steps (row/col s*L + i = step s+1, position i):
    the query of step j at position i is the j-th draft token of a tree rooted at p = i - j + 1, so it sees the
    target-feature keys (step 1) at positions <= p and the drafted keys of step k+1 at position p + k, k = 1..j-1
    (itself included). -> [steps*L, steps*L] bool."""
    i = torch.arange(length, device=device)
    allowed = torch.zeros(steps * length, steps * length, dtype=torch.bool, device=device)
    for s in range(steps):  # query step j = s + 1
        rows = s * length + i
        p = i - s  # the root of the simulated tree
        allowed[rows[:, None], i[None, :]] = i[None, :] <= p[:, None]  # target-feature keys up to the root
        for k in range(1, s + 1):  # drafted keys x^{k+1} at position p + k
            col = p + k
            ok = col >= 0
            allowed[rows[ok], k * length + col[ok]] = True
    return allowed


def up_to_start(starts: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Queries that see the true states up to their block's start: query q sees real keys k <= starts[q] (Beagle's
    window start n(q), MoA's last activation before the block); a query with nothing to see (starts[q] < 0) gets
    key 0, so no row is empty (such rows are never trained). starts [T], real [B, T] bool -> [B, T, T] bool."""
    idx = torch.arange(starts.shape[0], device=starts.device)
    allowed = (idx[None, :] <= starts[:, None])[None] & real[:, None, :]
    allowed[:, :, 0] |= (starts < 0)[None]
    return allowed


def in_block(starts: torch.Tensor, include_self: bool) -> torch.Tensor:
    """Keys inside the query's own block (after its start, blocks tiling the sequence) and before it, or up to itself:
    what a query sees of the block's drafted (predicted) states. starts [T] -> [T, T] bool."""
    idx = torch.arange(starts.shape[0], device=starts.device)
    before = idx[None, :] <= idx[:, None] if include_self else idx[None, :] < idx[:, None]
    return (idx[None, :] > starts[:, None]) & before


def tree_position_ids(anc: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position of the root = prefix_len; of a node = prefix_len + depth (its number of ancestors). [1, N+1]"""
    return (prefix_len - 1 + anc.sum(-1))[None]


def padded_ancestors(anc: torch.Tensor, size: int) -> torch.Tensor:
    """A row's ancestor matrix [n+1, n+1] padded to [size, size] for a batched tree forward: a padding node sees no
    tree node but itself (its outputs are never read)."""
    out = torch.eye(size, dtype=torch.bool, device=anc.device)
    out[: anc.shape[0], : anc.shape[0]] = anc
    return out


def batch_tree_mask(anc: torch.Tensor, prefixes: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Ragged rows in one forward (batched decoding): row a holds prefixes[a] cached entries and its S newest entries
    right behind them (the preallocated cache's ragged rows; this forward's own, or a drafter's drafted slots), so its
    query q sees columns [0, prefixes[a]) and the columns prefixes[a] + c where anc[a, q, c]; nothing else (another
    row's longer prefix is stale). anc [A, Q, S] bool (a tree forward's ancestor matrices, S = Q), prefixes [A] ->
    additive [A, 1, Q, width]."""
    a, q, s = anc.shape
    rel = torch.arange(width, device=anc.device)[None, :] - prefixes[:, None]  # [A, W] column - row's prefix
    if s == 0:  # no new entries: each row's prefix only
        return additive((rel < 0)[:, None, None, :].expand(a, 1, q, width), dtype)
    in_tree = (rel >= 0) & (rel < s)
    tree = anc.gather(2, rel.clamp(0, max(s - 1, 0))[:, None, :].expand(a, q, width)) & in_tree[:, None, :]  # [A, Q, W]
    return additive(((rel < 0)[:, None, :] | tree)[:, None], dtype)
