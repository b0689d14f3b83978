"""Draft-tree policies: EAGLE-2's dynamic tree, static top-rank paths and Medusa's tree from measured accuracies."""
import pytest
import torch

import itertools
import math
from pathlib import Path

from omegaconf import OmegaConf

from drafters.trees import DynamicTree, StaticTree, make_tree, paths_from_accuracies, sorted_paths
from specbench.errors import SpecbenchError
from specbench.decode.tree import node_depths


def expander(vocab: int, seed: int, calls: list):
    g = torch.Generator().manual_seed(seed)

    def expand(level):
        calls.append((level.nodes.tolist(), level.parents.tolist()))
        return torch.randn(level.nodes.shape[0], vocab, generator=g) * 3

    return expand


def lists(grown):
    return grown.tokens.tolist(), grown.parents.tolist()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("depth", "topk", "total"), [(6, 10, 60), (3, 4, 9), (1, 5, 3), (4, 2, 100)])
def test_dynamic_tree_keeps_the_best_ancestor_closed_nodes(seed, depth, topk, total):
    calls = []
    root = torch.randn(50, generator=torch.Generator().manual_seed(100 + seed)) * 3
    tokens, parents = lists(DynamicTree(depth, topk, total).grow(root, expander(50, seed, calls)))
    n = len(tokens)
    assert n == min(total - 1, topk + (depth - 1) * topk * topk)  # total_tokens counts the root (the authors' count)
    d = node_depths(parents)  # raises unless topological
    assert max(d) <= depth
    assert len(calls) == depth - 1 and all(len(nodes) == topk for nodes, _ in calls)
    # every expansion feeds nodes of one depth whose parents were expanded earlier
    expanded = {-1}
    for nodes, parents in calls:
        assert set(parents) <= expanded
        expanded |= set(nodes)
    # the root's top-k children are its k most likely tokens
    kids = [t for t, p in zip(tokens, parents) if p == -1]
    assert set(kids) <= set(root.topk(topk).indices.tolist())


def test_total_tokens_counts_the_root_as_the_authors_code_does():
    """EAGLE-2's `total_token=60` verifies 60 tokens, the root and 59 drafted (their `self.total_tokens = total_tokens
    - 1`); root_counted=false is this project's count before 2026-11-25 (60 drafted), kept to reproduce its runs."""
    root = torch.randn(50, generator=torch.Generator().manual_seed(7)) * 3
    grow = lambda **kw: DynamicTree(6, 10, 60, **kw).grow(root, expander(50, 0, []))  # noqa: E731
    assert len(grow().tokens) == 59 and len(grow(root_counted=False).tokens) == 60
    with pytest.raises(SpecbenchError, match="total_tokens >= 2"):
        DynamicTree(3, 2, 1)
    assert len(DynamicTree(3, 2, 1, root_counted=False).grow(root, expander(50, 0, [])).tokens) == 1


def test_dynamic_tree_rerank_prefers_likely_paths():
    """A root whose top child is near-certain: the deepest chain below it must survive the rerank."""
    root = torch.full((20,), -10.0)
    root[3] = 10.0

    def expand(level):
        out = torch.full((level.nodes.shape[0], 20), -10.0)
        out[:, 5] = 10.0
        return out

    chain, parents = lists(DynamicTree(depth=5, topk=3, total_tokens=6).grow(root, expand))
    assert max(node_depths(parents)) == 5 and chain[0] == 3 and chain.count(5) >= 4


def test_static_tree_follows_its_paths():
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    calls = []
    grown = StaticTree(paths).grow(torch.randn(30), expander(30, 0, calls))
    assert grown.parents.tolist() == sorted_paths(paths)[1] == [-1, -1, 0, 0, 1, 2]
    assert [len(nodes) for nodes, _ in calls] == [2, 1]  # depth 2 expands nodes 0 and 1, depth 3 expands node 2


@pytest.mark.parametrize(("paths", "message"), [([[0, 1]], "no parent"), ([[0], [0]], "distinct"), ([[]], "empty")])
def test_bad_paths_are_refused(paths, message):
    with pytest.raises(SpecbenchError, match=message):
        sorted_paths(paths)


def test_unknown_tree_kind():
    with pytest.raises(SpecbenchError, match="tree.kind"):
        make_tree("bushy")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nodes", [1, 5, 19])
def test_tree_from_accuracies_holds_the_most_likely_paths(seed, nodes):
    """The chosen nodes are the `nodes` paths with the largest acceptance probability among all paths (so no tree of
    that size has a larger expected acceptance length), and every prefix is in."""
    g = torch.Generator().manual_seed(seed)
    acc = (torch.rand(3, 4, generator=g).sort(descending=True).values * 0.6).tolist()  # [depth, rank]
    paths = paths_from_accuracies(acc, nodes)
    assert len(paths) == nodes and all(p[:-1] in paths for p in paths if len(p) > 1)
    value = lambda p: math.prod(acc[d][r] for d, r in enumerate(p))  # noqa: E731
    every = [list(p) for n in range(1, 4) for p in itertools.product(range(4), repeat=n)]
    best = sorted((value(p) for p in every), reverse=True)[:nodes]
    assert sorted((value(p) for p in paths), reverse=True) == pytest.approx(best)
    sorted_paths(paths, max_depth=3)  # a valid static tree


def test_tree_from_accuracies_is_prefix_closed_when_ranks_are_not_sorted():
    acc = [[0.1, 0.5], [0.9, 0.0]]  # rank 1 measured more accurate than rank 0 at depth 1
    assert paths_from_accuracies(acc, 3) == [[1], [1, 0], [0]]
    with pytest.raises(SpecbenchError, match="nodes >= 1"):
        paths_from_accuracies(acc, 0)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_sd_tree_rows_equal_a_plain_forward(kind):
    """The independent draft model growing a tree in its own cache (tree attention over drafted entries): every
    expanded node's next-token logits equal the model's plain forward over the verified tokens and the node's path,
    and the drafted entries are cropped off afterwards. Over two proposals, so the second starts from a used cache."""
    from drafters.sd import IndependentDrafter
    from specbench.decode.types import TargetState
    from tests.helpers import tiny_target

    target = tiny_target(scale=5.0)
    tree = ({"kind": "dynamic", "depth": 4, "topk": 3, "total_tokens": 10} if kind == "dynamic" else
            {"kind": "static", "paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]})
    torch.manual_seed(1)
    drafter = IndependentDrafter(target, tree=tree, module={"init_layers": [0, 2, -1]})
    seen = []

    class Recording:  # the drafter's policy, with every expand call and its logits recorded
        def __init__(self, policy):
            self.policy = policy

        def __getattr__(self, name):
            return getattr(self.policy, name)

        def grow_rows(self, root_logits, expand):  # (one tree: the batch-1 drafter's row 0)
            def rec(level):
                logits = expand(level)
                seen.append((level.nodes[0].tolist(), level.tokens[0].tolist(), level.parents[0].tolist(),
                             logits[0].clone()))
                return logits
            return self.policy.grow_rows(root_logits, rec)

    drafter.policy = Recording(drafter.policy)
    tokens = torch.tensor([[5, 17, 33, 17, 33, 9, 2, 40]])
    drafter.prefill(TargetState(tokens=tokens, hidden=None, kv=None))
    for extra in ([], [7, 8, 9]):
        tokens = torch.cat([tokens, torch.tensor([extra], dtype=torch.long)], 1)
        seen.clear()
        drafter.propose(TargetState(tokens=tokens, hidden=None, kv=None))
        assert seen and drafter.cache.cache.get_seq_length() == tokens.shape[1]  # (its DraftCache's)
        parent_of, tok = {}, {}
        for nodes, toks, parents, logits in seen:
            parent_of.update(zip(nodes, parents))
            tok.update(zip(nodes, toks))
            for node, row in zip(nodes, logits):
                path, a = [], node
                while a >= 0:
                    path.insert(0, tok[a])
                    a = parent_of[a]
                ids = torch.cat([tokens, torch.tensor([path])], 1)
                ref = drafter.model(input_ids=ids).logits[0, -1]
                torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4)


# EAGLE-1's static tree as its authors wrote it: `mc_sim_7b_63` in eagle/model/choices.py of SafeAILab/EAGLE (the same
# from their first commit 88d6ab4 to cb7e084), copied verbatim. 25 nodes despite the name (Medusa's 63-node tree of
# that name is another tree).
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("seed", range(3))
def test_static_tree_config_is_eagle1s_mc_sim_7b_63(seed):
    tree = OmegaConf.to_container(OmegaConf.load(CONF / "tree" / "static.yaml"))
    assert tree["kind"] == "static" and tree["paths"] == MC_SIM_7B_63
    policy = make_tree(**tree)
    assert isinstance(policy, StaticTree) and policy.width == 4  # ranks up to top-4, as the authors' list
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(40, generator=g) * 3
    seen = {}

    def expand(level):
        logits = torch.randn(level.nodes.shape[0], 40, generator=g) * 3
        seen.update({n: row for n, row in zip(level.nodes.tolist(), logits)})
        return logits

    tokens, parents = lists(policy.grow(root, expand))
    d = node_depths(parents)
    assert len(tokens) == 25 and max(d) == 5
    assert [d.count(k) for k in range(1, 6)] == [4, 8, 8, 3, 2]
    # the authors' convention: path p's token is the rank-p[-1] token of its parent's draft distribution
    for i, p in enumerate(policy.paths):
        parent_logits = root if parents[i] == -1 else seen[parents[i]]
        assert tokens[i] == parent_logits.topk(4).indices[p[-1]].item()
        assert p[:-1] == (policy.paths[parents[i]] if parents[i] >= 0 else [])


# each paper experiment's tree for its tree drafters (conf/experiment/*.yaml; depth as DynamicTree counts it)
PAPER_TREES = {
    "beagle_table1": {"kind": "dynamic", "depth": 6, "topk": 10, "total_tokens": 60, "root_counted": True},  # papers/000 Sec. 5.1
    "coral_table2": {"kind": "dynamic", "depth": 6, "topk": 10, "total_tokens": 60, "root_counted": True},  # papers/003 Sec. 4.1
    "moa_table2": {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62, "root_counted": False},  # papers/002 Sec. 4
    "moa_tli_context": {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62, "root_counted": False},  # moa_table2's
}


@pytest.mark.parametrize("experiment", sorted(PAPER_TREES))
def test_each_experiment_decodes_with_its_papers_tree(experiment):
    """Every dynamic-tree drafter of the sweep composes the paper's tree; eagle keeps EAGLE-1's static tree (the
    experiment's dynamic settings merged into it are ignored by StaticTree); the others draft no conf/tree."""
    from hydra import compose, initialize_config_dir

    from specbench.core.config import register_schema

    params = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml").hydra.sweeper.params
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for drafter in params.drafter.split(","):
            cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", f"drafter={drafter}"])
            tree = OmegaConf.to_container(cfg.drafter, resolve=True).get("tree")
            if drafter == "eagle":
                assert tree["kind"] == "static" and tree["paths"] == MC_SIM_7B_63
                assert make_tree(**tree).paths == sorted_paths(MC_SIM_7B_63)[0]
            elif isinstance(tree, dict):
                assert {k: tree[k] for k in PAPER_TREES[experiment]} == PAPER_TREES[experiment], drafter
                policy = make_tree(**tree)
                drafted = tree["total_tokens"] - tree["root_counted"]  # MoA's code counts drafted nodes, EAGLE's the root too
                assert (policy.depth, policy.topk, policy.total) == (tree["depth"], tree["topk"], drafted)
            else:
                assert drafter in ("none", "pld", "sd", "medusa"), drafter


# ---- the policies as they were written before they ran on the device (lists on the host, one read per node):
# the device versions must grow the same trees, token for token. expand(nodes, their tokens, their depth).
def reference_static(policy, root_logits, expand):
    tokens = [0] * len(policy.paths)
    top = root_logits.topk(policy.width).indices.tolist()
    for i, p in enumerate(policy.paths):
        if len(p) == 1:
            tokens[i] = top[p[0]]
    for d in range(2, policy.depth + 1):
        kids = [i for i, p in enumerate(policy.paths) if len(p) == d]
        feed = sorted({policy.parents[i] for i in kids})
        top = expand(feed, [tokens[i] for i in feed], d - 1).topk(policy.width, dim=-1).indices.tolist()
        for i in kids:
            tokens[i] = top[feed.index(policy.parents[i])][policy.paths[i][-1]]
    return tokens, list(policy.parents)


def reference_dynamic(policy, root_logits, expand):
    k = min(policy.topk, root_logits.shape[-1])
    logp = root_logits.float().log_softmax(-1).topk(k)
    tokens, parents = logp.indices.tolist(), [-1] * k
    scores = logp.values.tolist()
    frontier = list(range(k))
    for depth in range(1, policy.depth):
        logits = expand(frontier, [tokens[i] for i in frontier], depth)
        child = logits.float().log_softmax(-1).topk(k, dim=-1)
        base = torch.tensor([scores[i] for i in frontier])[:, None] + child.values
        first = len(tokens)
        for r, parent in enumerate(frontier):
            tokens += child.indices[r].tolist()
            parents += [parent] * k
        scores += base.reshape(-1).tolist()
        frontier = [first + j for j in base.reshape(-1).topk(min(k, base.numel())).indices.tolist()]
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: policy.total])
    new = {old: n for n, old in enumerate(keep)}
    return [tokens[i] for i in keep], [new[parents[i]] if parents[i] >= 0 else -1 for i in keep]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tree", [
    {"kind": "dynamic", "depth": 6, "topk": 10, "total_tokens": 60},
    {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62},
    {"kind": "dynamic", "depth": 4, "topk": 3, "total_tokens": 100},
    {"kind": "dynamic", "depth": 5, "topk": 1, "total_tokens": 3},
    {"kind": "static", "paths": MC_SIM_7B_63},
    {"kind": "static", "paths": [[0], [0, 0], [0, 0, 0]]},
])
def test_device_policies_grow_the_host_policies_trees(seed, tree):
    """Token for token and parent for parent, with integer logits so that ties (which the rerank breaks towards the
    earlier node) are frequent; every expand is fed the same nodes, tokens and depth."""
    g = torch.Generator().manual_seed(seed)
    root = (torch.randn(40, generator=g) * 2).round()
    table = (torch.randn(4096, 40, generator=g) * 2).round()  # a node's logits: a row picked by its id, token, depth
    policy = make_tree(**tree)
    ours_calls, ref_calls = [], []

    def ours(level):
        ours_calls.append((level.nodes.tolist(), level.tokens.tolist(), level.depth))
        return table[(level.tokens * 7 + level.depth * 131 + level.nodes) % 4096]

    def ref(nodes, tokens, depth):
        ref_calls.append((list(nodes), list(tokens), depth))
        return table[torch.tensor([(t * 7 + depth * 131 + v) % 4096 for v, t in zip(nodes, tokens)])]

    grown = policy.grow(root, ours)
    want = (reference_static if tree["kind"] == "static" else reference_dynamic)(policy, root, ref)
    assert lists(grown) == want
    assert ours_calls == ref_calls
    assert grown.is_chain == (want[1] == list(range(-1, len(want[1]) - 1)))
