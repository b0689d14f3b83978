"""Draft-tree geometry: depths, the tree attention mask and position ids for one target forward over all nodes.

Row 0 of every tree forward is the root (the last verified token); rows 1..N are the drafted nodes. Node i sees the
cached prefix, the root, its ancestors and itself (SpecInfer / Medusa / EAGLE tree attention).

The forward's geometry is computed on the device from the parents tensor (no host transfer, no per-node Python);
`node_depths` / `is_chain` are the host-side versions the engine's bookkeeping uses once the step's outcome is read.
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


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """anc[r, c] = True when row c is row r or one of its ancestors (row 0 = root, row i+1 = node i).
    parents [N] (-1 = the root) -> [N+1, N+1] bool, on parents' device.

    Pointer doubling: after j rounds anc[r] holds r's ancestors less than 2^j levels up and up[r] is its 2^j-th
    ancestor (the root being its own parent), so ceil(log2(N+1)) rounds of tensor ops cover any depth <= N."""
    n = parents.shape[0]
    up = torch.cat([parents.new_zeros(1), parents + 1])  # [N+1] parent row of every row
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    for _ in range(n.bit_length()):
        anc = anc | anc[up]
        up = up[up]
    return anc


def visible(seen: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Rows that see a cached prefix of prefix_len entries and the later columns `seen` marks.
    seen [R, S] bool -> [1, 1, R, prefix+S] bool (True = may attend), for attention that takes a boolean mask."""
    prefix = torch.ones(seen.shape[0], prefix_len, dtype=torch.bool, device=seen.device)
    return torch.cat([prefix, seen], -1)[None, None]


def tree_attention_mask(seen: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of `visible`: 0 where attention is allowed, dtype-min elsewhere. [1, 1, R, prefix+S]
    The target's tree forward passes its ancestor matrix (ancestor_matrix, [N+1, N+1]); a drafter growing a tree in
    its own cache passes which drafted slots each new row sees (drafters/trees.py GrowingTree)."""
    mask = torch.zeros(1, 1, seen.shape[0], prefix_len + seen.shape[1], dtype=dtype, device=seen.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~seen, torch.finfo(dtype).min)
    return mask


def tree_position_ids(anc: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position of the root = prefix_len; of a node = prefix_len + depth (its number of ancestors). [1, N+1]"""
    return (prefix_len - 1 + anc.sum(-1))[None]
