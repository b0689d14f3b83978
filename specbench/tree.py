"""Draft-tree geometry: depths, the tree attention mask and position ids for one target forward over all nodes.

Row 0 of every tree forward is the root (the last verified token); rows 1..N are the drafted nodes. Node i sees the
cached prefix, the root, its ancestors and itself (SpecInfer / Medusa / EAGLE tree attention).
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


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """anc[r, c] = True when row c is row r or one of its ancestors (row 0 = root, row i+1 = node i). [N+1, N+1]"""
    n = len(parents)
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    anc[0, 0] = True
    for i, p in enumerate(parents):
        anc[i + 1] = anc[p + 1]
        anc[i + 1, i + 1] = True
    return anc


def tree_attention_mask(
    parents: list[int], prefix_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Additive mask for the tree forward: 0 where attention is allowed, dtype-min elsewhere. [1, 1, N+1, prefix+N+1]"""
    anc = ancestor_matrix(parents).to(device)
    n1 = anc.shape[0]
    mask = torch.zeros(1, 1, n1, prefix_len + n1, dtype=dtype, device=device)
    mask[0, 0, :, prefix_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask


def tree_position_ids(parents: list[int], prefix_len: int, device: torch.device | str) -> torch.Tensor:
    """Position of the root = prefix_len; of a node = prefix_len + depth. [1, N+1]"""
    return torch.tensor([[prefix_len] + [prefix_len + d for d in node_depths(parents)]], device=device)


def children_lists(parents: list[int]) -> list[list[int]]:
    """children[r] for r in rows (0 = root, i+1 = node i), in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids
