"""Draft-tree policies shared by tree drafters (Medusa, EAGLE-1/2, HASS, CORAL, Beagle, MoA).

A policy grows a tree from the root's next-token logits and an `expand(level) -> logits` callback that runs the
drafter on already-drafted nodes (all at one depth, in one batch) and returns their children's logits [n, V].
`grow_rows` grows one tree per row of a batch at once (root logits [A, V], levels of [A, n] nodes, expand -> [A, n, V]);
`grow` is its one-row form. Everything stays on the drafter's device: no host reads per node or per depth
(tests/test_roundtrips.py).

- StaticTree (Medusa sparse trees, EAGLE-1): a fixed set of paths of top-k ranks, e.g. [0, 1] = the top-1 child of
  the root, then the top-2 child below it: the convention of Medusa's and EAGLE's `*_choices` lists (the EAGLE
  authors' generate_tree_buffers sorts them by (length, ranks) and takes the last rank of a path from its parent's
  top-k, as `grow` does), so their lists are used as they are (conf/tree/static.yaml: EAGLE-1's mc_sim_7b_63).
- DynamicTree (EAGLE-2, as used by Beagle, MoA and CORAL): at depth 1 keep the top-k children of the root; at every
  further depth expand the top-k frontier nodes by cumulative draft log-probability, each into its top-k children;
  finally rerank every drafted node by cumulative log-probability and keep the best `total_tokens - 1` (the root
  makes `total_tokens`, the authors' count; `root_counted: false` keeps `total_tokens`, MoA's code's count).
Drafted tokens are deterministic top-k choices, so the trees carry no q (verification uses q = 1, lossless).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specbench.errors import SpecbenchError
from specbench.decode.tree import is_chain
from specbench.decode.drafter import chain_paths
from specbench.decode.types import DraftTree, TargetState


@dataclass(frozen=True)
class Level:
    """Already-drafted nodes of one depth whose children a policy asks for (every ancestor of theirs was expanded
    earlier). Tensors on the drafter's device: a policy never reads them on the host."""

    nodes: torch.Tensor  # [n] node ids (indices into the policy's drafted nodes); [A, n] in grow_rows
    tokens: torch.Tensor  # [n] their tokens ([A, n])
    parents: torch.Tensor  # [n] their parents' node ids, -1 = the root ([A, n])
    depth: int  # their depth, the root's children being 1 (a row's position is the root's + depth)


# a Level -> its nodes' children's logits [n, V] ([A, n, V] in grow_rows)
Expand = Callable[[Level], torch.Tensor]


@dataclass
class Grown:
    tokens: torch.Tensor  # [A, N] in topological order, one tree per row ([N]: grow's one tree)
    parents: torch.Tensor  # [A, N], -1 = root
    is_chain: bool = False  # known from the policy's shape alone (no host read): the target's causal mask applies
    priority: torch.Tensor | None = None  # [A, N] the policy's order of preference (higher first; see DraftTree)

    def row(self, a: int) -> "Grown":
        return Grown(self.tokens[a], self.parents[a], self.is_chain, None if self.priority is None else self.priority[a])

    def draft(self) -> DraftTree:
        """The step's proposal, one tree per row (every row the same node count)."""
        return DraftTree(tokens=self.tokens, parents=self.parents, is_chain=self.is_chain, priority=self.priority)


def one_row(expand: Expand) -> Expand:
    """A one-row expand ([n] levels -> [n, V]) as grow_rows calls it (levels [1, n] -> [1, n, V])."""
    return lambda lv: expand(Level(lv.nodes[0], lv.tokens[0], lv.parents[0], lv.depth))[None]


class GrowingTree:
    """The drafted slots of a drafter's own cache that each node's row attends to (its own and its drafted ancestors'),
    kept as a bool matrix on the device that grows with the tree: the rows of one `expand` are appended to the cache
    together, in node order, so slot j is the j-th drafted entry. Row 0 is the root; row v+1 node v.
    With `root_slot`, slot 0 is the root's own drafted entry (Beagle, MoA's caches), seen by every row.
    `trees` trees at once (a batch's rows, each its own shape): nodes and parents [A, n]."""

    def __init__(self, capacity: int, device: torch.device | str, root_slot: bool = False, trees: int = 1):
        self.seen = torch.ones(trees, capacity + 1, int(root_slot), dtype=torch.bool, device=device)  # [A, cap+1, S]

    @property
    def slots(self) -> int:
        return self.seen.shape[2]

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        """seen's rows `index` [A, n] of each tree -> [A, n, S] (a copy)."""
        return self.seen.gather(1, index[:, :, None].expand(-1, -1, self.slots))

    def ancestors(self, parents: torch.Tensor) -> torch.Tensor:
        """Rows seeing the drafted ancestors of nodes with these parents [A, n], not the nodes themselves: [A, n, S]."""
        return self._rows(parents + 1)

    def add(self, nodes: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Give nodes [A, n] (children of parents [A, n]) the next n slots; returns their rows, own slot + ancestors':
        [A, n, S+n]."""
        n, s0 = nodes.shape[1], self.slots
        self.seen = torch.cat([self.seen, self.seen.new_zeros(*self.seen.shape[:2], n)], 2)
        rows = self._rows(parents + 1)
        rows[:, :, s0:] = torch.eye(n, dtype=torch.bool, device=rows.device)
        self.seen.scatter_(1, (nodes + 1)[:, :, None].expand(-1, -1, s0 + n), rows)
        return rows


# step(tokens [A, m], parents' features [A, m, D], positions [A, m], mask) -> the nodes' features [A, m, D]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow_by_features(policy, root: torch.Tensor, at, dtype: torch.dtype, step: Step,
                     logits: Callable[[torch.Tensor], torch.Tensor]) -> Grown:
    """Feature-level autoregression (EAGLE-1/2, HASS, CORAL, EAGLE-3): the policy's trees grown from each row's root
    feature root [A, D], a node's input being its token and its parent's output feature (the root's at depth 1). Each
    level is one `step` over its [A, m] nodes, at the geometry at(seen [A, m, S], depth, dtype) gives in the drafter's
    cache (specbench/decode/draftcache.py At); logits(features [.., D]) -> [.., V] scores their children."""
    a, d = root.shape
    book = GrowingTree(policy.max_nodes, root.device, trees=a)
    feats = root.new_empty(a, policy.max_nodes + 1, d)  # [A, 1 + nodes, D] row v+1: node v's output
    feats[:, 0] = root  # row 0: the root's

    def expand(level: Level) -> torch.Tensor:
        f_in = feats.gather(1, (level.parents + 1)[:, :, None].expand(-1, -1, d))  # [A, m, D] the parents' outputs
        pos, mask = at(book.add(level.nodes, level.parents), level.depth, dtype)
        f = step(level.tokens, f_in, pos, mask)  # [A, m, D]
        feats.scatter_(1, (level.nodes + 1)[:, :, None].expand(-1, -1, d), f)
        return logits(f)

    return policy.grow_rows(logits(root), expand)


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


def list_order(given: list[list[int]], paths: list[list[int]]) -> list[float]:
    """Each of `paths` (topologically sorted) ranked by its place in the `given` list, as a priority (higher first):
    the authors' lists and paths_from_accuracies put likelier paths first, each after its prefix, so the first n
    paths are the tree of n nodes (specbench/bench/costmodel.py replays smaller trees on this order)."""
    order = {tuple(p): i for i, p in enumerate(given)}
    return [-float(order[tuple(p)]) for p in paths]


class TreePolicy:
    """A tree policy: `max_nodes` (the most a tree drafts), `expanded(vocab)`, `prepare(device)` and `grow_rows`;
    `grow` is the one-tree form of grow_rows."""

    max_nodes: int

    def prepare(self, device: torch.device) -> None:
        """Tensors made ahead of a compiled region (StaticTree's indices); none by default."""

    def grow(self, root_logits: torch.Tensor, expand: Expand) -> Grown:
        """One tree: root_logits [V], expand on [n] levels (grow_rows at one row)."""
        return self.grow_rows(root_logits[None], one_row(expand)).row(0)


class StaticTree(TreePolicy):
    def __init__(self, paths: list[list[int]], **_):
        self.paths, self.parents = sorted_paths(paths)
        self.priority = list_order(paths, self.paths)  # the list's own order is its preference
        self.depth = max(len(p) for p in self.paths)
        self.width = 1 + max(max(p) for p in self.paths)
        self.max_nodes = len(self.paths)
        self.is_chain = is_chain(self.parents)
        self._index: dict[torch.device, tuple] = {}  # the fixed index tensors, per device
        # nodes fed to `expand` over a whole tree (each level's parents): the entries a drafter's cache takes
        self.fed = len({self.parents[i] for i, p in enumerate(self.paths) if len(p) > 1})

    def expanded(self, vocab: int) -> int:
        """Nodes fed to `expand` while one tree grows (the drafted entries it appends to a drafter's cache)."""
        del vocab  # the paths fix them
        return self.fed

    def prepare(self, device: torch.device) -> None:
        """The fixed index tensors for `device`, made now (specbench/decode/draftcache.py CompiledTree: before its
        region, whose outputs a CUDA graph's next replay would overwrite)."""
        self._indices(device)

    def _indices(self, device: torch.device) -> tuple:
        """(parents [N], depth-1 nodes, their ranks, [(depth, fed nodes, depth-d nodes, their row in fed, rank)],
        priority [N])."""
        if device not in self._index:
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731 (once per device)
            first = [i for i, p in enumerate(self.paths) if len(p) == 1]
            levels = []
            for d in range(2, self.depth + 1):
                kids = [i for i, p in enumerate(self.paths) if len(p) == d]
                feed = sorted({self.parents[i] for i in kids})
                levels.append((d, t(feed), t(kids), t([feed.index(self.parents[i]) for i in kids]),
                               t([self.paths[i][-1] for i in kids])))
            self._index[device] = (t(self.parents), t(first), t([self.paths[i][0] for i in first]), levels,
                                   torch.tensor(self.priority, device=device))
        return self._index[device]

    def grow_rows(self, root_logits: torch.Tensor, expand: Expand) -> Grown:
        """root_logits [A, V]; every row the same paths, each with its own tokens."""
        parents, first, first_rank, levels, priority = self._indices(root_logits.device)
        a = root_logits.shape[0]
        tokens = torch.zeros(a, len(self.paths), dtype=torch.long, device=root_logits.device)
        tokens[:, first] = root_logits.topk(self.width, dim=-1).indices[:, first_rank]
        for d, feed, kids, row, rank in levels:
            logits = expand(Level(feed.expand(a, -1), tokens[:, feed], parents[feed].expand(a, -1), d - 1))
            tokens[:, kids] = logits.topk(self.width, dim=-1).indices[:, row, rank]
        return Grown(tokens, parents.expand(a, -1), self.is_chain, priority.expand(a, -1))


class DynamicTree(TreePolicy):
    """EAGLE-2's dynamic tree. `depth` counts drafted levels, the root's top-k children being level 1 (the root, the
    last verified token, is not counted): depth D drafts `topk` + (D-1) `topk`^2 nodes in D-1 `expand` calls and keeps
    the best `total_tokens - 1` of them (with the root, `total_tokens` verified). The authors' code counts depth one
    less: EAGLE-2's (and HASS's) `topK_genrate` takes the root's top-k before a loop of `depth` iterations, each
    adding a level, so their `--depth 5` (the default of their evaluation scripts, with --top-k 10 --total-token 60)
    drafts 6 levels: depth 6 here. The papers count as here: MoA's D (papers/002 Sec. 2.2: "B + (D-1)B^2 nodes");
    CORAL's "tree depth of 6" (papers/003 Sec. 4.1), its settings "primarily identical" to the HASS / EAGLE-2
    code's (default --depth 5).
    Beagle's "depth=1+6" (papers/000 Sec. 5.1, EAGLE-2's hyperparameters) is read as the root plus 6 drafted levels:
    depth 6 here (were it the code's --depth 6, it would be 7 here). conf/tree/dynamic.yaml points here.
    `total_tokens` counts as the authors' code does (`root_counted`, default true; EAGLE's and EAGLE-3's
    `Model.__init__`: `self.total_tokens = total_tokens - 1`; their help: "the total number of drafted tokens in the
    tree + 1"): `total_tokens` verified, the root and `total_tokens - 1` drafted. `root_counted: false` keeps
    `total_tokens` drafted nodes: MoA's code's count (HEBO mixture-of-attentions `moa_spec.py`: `self.total_tokens =
    total_tokens`, a (total_tokens + 1)-square mask; conf/experiment/moa_table2.yaml), and this project's before the
    issue-27 re-run (the runs of then have no `root_counted` in their run.json, so their names differ from today's).
    Grown with tensor ops on the drafter's device (selection, expansion and rerank), as the authors' depth loop."""

    def __init__(self, depth: int = 6, topk: int = 10, total_tokens: int = 60, root_counted: bool = True, **_):
        self.depth, self.topk, self.total_tokens = depth, topk, total_tokens
        self.total = total_tokens - 1 if root_counted else total_tokens  # drafted nodes kept
        if depth < 1 or topk < 1 or self.total < 1:
            raise SpecbenchError(f"dynamic tree needs depth, topk >= 1 and total_tokens >= {2 if root_counted else 1} "
                                 "(at least one drafted node)")
        self.max_nodes = topk + (depth - 1) * topk * topk

    def expanded(self, vocab: int) -> int:
        """Nodes fed to `expand` while one tree grows: the frontier, min(topk, vocab) at each of depth - 1 levels."""
        return min(self.topk, vocab) * (self.depth - 1)

    def grow_rows(self, root_logits: torch.Tensor, expand: Expand) -> Grown:
        """root_logits [A, V]: one tree per row, every row k + (depth-1) k^2 drafted and `total` kept."""
        a = root_logits.shape[0]
        k = min(self.topk, root_logits.shape[-1])
        root = root_logits.float().log_softmax(-1).topk(k, dim=-1)  # [A, k]
        device = root_logits.device
        # the frontier: node ids, tokens, parents, cumulative log-probs, [A, k] each
        f_nodes = torch.arange(k, device=device).expand(a, k)
        f_tok, f_par, f_score = root.indices, torch.full((a, k), -1, dtype=torch.long, device=device), root.values
        tokens, parents, scores = [f_tok], [f_par], [f_score]  # every drafted node, level by level
        n = k
        for depth in range(1, self.depth):
            logits = expand(Level(f_nodes, f_tok, f_par, depth))  # [A, k, V]
            child = logits.float().log_softmax(-1).topk(k, dim=-1)  # [A, k, k]
            score = (f_score[:, :, None] + child.values).reshape(a, -1)  # [A, k*k] each child's cumulative log-prob
            tok, par = child.indices.reshape(a, -1), f_nodes[:, :, None].expand(-1, -1, k).reshape(a, -1)
            tokens, parents, scores = tokens + [tok], parents + [par], scores + [score]
            best = score.topk(min(k, score.shape[-1]), dim=-1).indices  # the next frontier: the k likeliest children
            f_nodes, f_tok, f_par, f_score = n + best, tok.gather(1, best), par.gather(1, best), score.gather(1, best)
            n += score.shape[-1]
        tokens, parents, scores = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)  # [A, n]
        # rerank: a child never scores above its parent, so the best-N set is closed under ancestors when ties go to
        # the earlier (shallower) node: a stable descending sort
        keep = scores.sort(dim=-1, descending=True, stable=True).indices[:, : self.total].sort(-1).values  # [A, N]
        new_id = torch.full((a, n), -1, dtype=torch.long, device=device)
        new_id.scatter_(1, keep, torch.arange(keep.shape[1], device=device).expand(a, -1))
        par = parents.gather(1, keep)
        return Grown(tokens.gather(1, keep), torch.where(par >= 0, new_id.gather(1, par.clamp(min=0)), -1),
                     is_chain=k == 1, priority=scores.gather(1, keep))  # the best n of these: the tree of n nodes


def chain_alone(drafter, state: TargetState, n: int) -> torch.Tensor:
    """A tree drafter's greedy text when the target is gone (a split's verifier, Table 4): one propose_rows with its
    policy swapped for a chain of n -> tokens [A, n]."""
    policy, drafter.policy = drafter.policy, make_tree(kind="static", paths=chain_paths(n))
    try:
        return drafter.propose_rows(state).tokens
    finally:
        drafter.policy = policy


def make_tree(kind: str, **options):
    policies = {"static": StaticTree, "dynamic": DynamicTree}
    if kind not in policies:
        raise SpecbenchError(f"tree.kind={kind!r} is not one of {', '.join(policies)}")
    return policies[kind](**options)
