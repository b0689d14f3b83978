"""Draft-tree policies shared by tree drafters (Medusa, EAGLE-1/2, HASS, CORAL, Beagle, MoA).

A policy grows a tree from the root's next-token logits and an `expand(nodes) -> logits` callback that runs the
drafter on already-drafted nodes (all at one depth, in one batch) and returns their children's logits [n, V].

- StaticTree (Medusa sparse trees, EAGLE-1): a fixed set of paths of top-k ranks, e.g. [0, 1] = the top-1 child of
  the root, then the top-2 child below it: the convention of Medusa's and EAGLE's `*_choices` lists (the EAGLE
  authors' generate_tree_buffers sorts them by (length, ranks) and takes the last rank of a path from its parent's
  top-k, as `grow` does), so their lists are used as they are (conf/tree/static.yaml: EAGLE-1's mc_sim_7b_63).
- DynamicTree (EAGLE-2, as used by Beagle, MoA and CORAL): at depth 1 keep the top-k children of the root; at every
  further depth expand the top-k frontier nodes by cumulative draft log-probability, each into its top-k children;
  finally rerank every drafted node by cumulative log-probability and keep the best `total_tokens`.
Drafted tokens are deterministic top-k choices, so the trees carry no q (verification uses q = 1, lossless).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specbench.errors import SpecbenchError

# (node indices, their tokens, their parents) -> the children's logits [n, V]; nodes are all at one depth and every
# ancestor of theirs was expanded earlier
Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]


@dataclass
class Grown:
    tokens: list[int]  # [N] in topological order
    parents: list[int]  # [N], -1 = root


def draft_mask(prefix: int, slots: list[list[int]], total: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask for new draft rows: every row sees the verified prefix and the cache slots it lists. [1,1,R,total]"""
    m = torch.full((1, 1, len(slots), total), torch.finfo(dtype).min, dtype=dtype, device=device)
    m[..., :prefix] = 0
    for r, cols in enumerate(slots):
        m[0, 0, r, cols] = 0
    return m


class GrowingTree:
    """What a drafter with its own KV cache tracks while a policy grows a tree in it: each expanded node's parent,
    depth and cache slot (the rows of one `expand` call are appended to the cache together, from slot `first`)."""

    def __init__(self):
        self.parent: dict[int, int] = {}
        self.depth: dict[int, int] = {-1: 0}
        self.slot: dict[int, int] = {}

    def add(self, nodes: list[int], parents: list[int], first: int) -> None:
        for j, (node, par) in enumerate(zip(nodes, parents)):
            self.parent[node], self.depth[node], self.slot[node] = par, self.depth[par] + 1, first + j

    def lineage(self, node: int) -> list[int]:
        """The node and its drafted ancestors, deepest first (the root, -1, excluded)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out

    def rows(self, nodes: list[int]) -> list[list[int]]:
        """Per node, the cache slots its row attends to besides the verified prefix: itself and its ancestors."""
        return [[self.slot[a] for a in self.lineage(v)] for v in nodes]


def sorted_paths(paths: list[list[int]], max_depth: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Sort top-rank paths by (length, ranks); return them with each one's parent index. Every prefix must exist."""
    paths = sorted((list(p) for p in paths), key=lambda p: (len(p), p))
    pos = {tuple(p): i for i, p in enumerate(paths)}
    if len(pos) != len(paths):
        raise SpecbenchError("tree paths must be distinct")
    parents = []
    for p in paths:
        if not p or (max_depth is not None and len(p) > max_depth):
            raise SpecbenchError(f"tree path {p} is empty or deeper than {max_depth}")
        if len(p) > 1 and tuple(p[:-1]) not in pos:
            raise SpecbenchError(f"tree path {p} has no parent path {p[:-1]}")
        parents.append(pos[tuple(p[:-1])] if len(p) > 1 else -1)
    return paths, parents


def paths_from_accuracies(acc: list[list[float]], nodes: int) -> list[list[int]]:
    """Medusa's sparse tree (papers/001, "optimized sparse trees"): acc[d][i] = measured probability that the rank-i
    candidate at depth d+1 is the target's token. Assuming depths independent, a path's chance of being accepted
    whole is the product of its ranks' accuracies, and the expected acceptance length of a tree is the sum of that
    over its nodes. Greedily add the node with the largest product whose parent is already in: every prefix of a
    path scores at least as high as the path, so this keeps the tree prefix-closed."""
    if nodes < 1 or not acc or not acc[0]:
        raise SpecbenchError("a tree from accuracies needs nodes >= 1 and at least one measured rank")
    chosen: list[list[int]] = []
    frontier = {(i,): acc[0][i] for i in range(len(acc[0]))}
    while frontier and len(chosen) < nodes:
        path = max(frontier, key=lambda p: (frontier[p], [-r for r in p]))  # ties: shallower ranks first
        score = frontier.pop(path)
        chosen.append(list(path))
        if len(path) < len(acc):
            frontier.update({(*path, i): score * a for i, a in enumerate(acc[len(path)])})
    return chosen


class StaticTree:
    def __init__(self, paths: list[list[int]], **_):
        self.paths, self.parents = sorted_paths(paths)
        self.depth = max(len(p) for p in self.paths)
        self.width = 1 + max(max(p) for p in self.paths)

    def grow(self, root_logits: torch.Tensor, expand: Expand) -> Grown:
        """root_logits [V]."""
        tokens = [0] * len(self.paths)
        top = root_logits.topk(self.width).indices.tolist()
        for i, p in enumerate(self.paths):
            if len(p) == 1:
                tokens[i] = top[p[0]]
        for d in range(2, self.depth + 1):
            kids = [i for i, p in enumerate(self.paths) if len(p) == d]
            feed = sorted({self.parents[i] for i in kids})
            logits = expand(feed, [tokens[i] for i in feed], [self.parents[i] for i in feed])
            top = logits.topk(self.width, dim=-1).indices.tolist()
            for i in kids:
                tokens[i] = top[feed.index(self.parents[i])][self.paths[i][-1]]
        return Grown(tokens, list(self.parents))


class DynamicTree:
    """EAGLE-2's dynamic tree. `depth` counts drafted levels, the root's top-k children being level 1 (the root, the
    last verified token, is not counted): depth D drafts `topk` + (D-1) `topk`^2 nodes in D-1 `expand` calls and keeps
    the best `total_tokens` of them (the root not counted either). The authors' code counts one less: EAGLE-2's (and
    HASS's) `topK_genrate` takes the root's top-k before a loop of `depth` iterations, each adding a level, so their
    `--depth 5` (the default of their evaluation scripts, with --top-k 10 --total-token 60) drafts 6 levels: depth 6
    here. The papers count as here: MoA's D (papers/002 Sec. 2.2: "B + (D-1)B^2 nodes"); CORAL's "tree depth of 6"
    (papers/003 Sec. 4.1), its settings "primarily identical" to the HASS / EAGLE-2 code's (default --depth 5).
    Beagle's "depth=1+6" (papers/000 Sec. 5.1, EAGLE-2's hyperparameters) is read as the root plus 6 drafted levels:
    depth 6 here (were it the code's --depth 6, it would be 7 here). conf/tree/dynamic.yaml points here."""

    def __init__(self, depth: int = 6, topk: int = 10, total_tokens: int = 60, **_):
        if depth < 1 or topk < 1 or total_tokens < 1:
            raise SpecbenchError("dynamic tree needs depth, topk and total_tokens >= 1")
        self.depth, self.topk, self.total = depth, topk, total_tokens

    def grow(self, root_logits: torch.Tensor, expand: Expand) -> Grown:
        k = min(self.topk, root_logits.shape[-1])
        logp = root_logits.float().log_softmax(-1).topk(k)
        tokens, parents = logp.indices.tolist(), [-1] * k
        scores = logp.values.tolist()  # cumulative draft log-probability of each node
        frontier = list(range(self.topk))
        for _ in range(2, self.depth + 1):
            logits = expand(frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier])
            child = logits.float().log_softmax(-1).topk(k, dim=-1)
            base = torch.tensor([scores[i] for i in frontier])[:, None] + child.values.cpu()  # [k, k]
            first = len(tokens)
            for r, parent in enumerate(frontier):
                tokens += child.indices[r].tolist()
                parents += [parent] * k
            scores += base.reshape(-1).tolist()
            best = base.reshape(-1).topk(min(k, base.numel())).indices.tolist()
            frontier = [first + j for j in best]
        # rerank: a child never scores above its parent, so the best-N set is closed under ancestors when ties
        # go to the earlier (shallower) node
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.total])
        new = {old: n for n, old in enumerate(keep)}
        return Grown([tokens[i] for i in keep], [new[parents[i]] if parents[i] >= 0 else -1 for i in keep])


def make_tree(kind: str, **options):
    policies = {"static": StaticTree, "dynamic": DynamicTree}
    if kind not in policies:
        raise SpecbenchError(f"tree.kind={kind!r} is not one of {', '.join(policies)}")
    return policies[kind](**options)
