"""Draft-tree policies: EAGLE-2's dynamic tree, static top-rank paths and Medusa's tree from measured accuracies."""
import pytest
import torch

import itertools
import math
from pathlib import Path

from omegaconf import OmegaConf

from drafters.trees import DynamicTree, StaticTree, make_tree, paths_from_accuracies, sorted_paths
from specbench.errors import SpecbenchError
from specbench.tree import node_depths


def expander(vocab: int, seed: int, calls: list):
    g = torch.Generator().manual_seed(seed)

    def expand(nodes, tokens, parents):
        calls.append((list(nodes), list(parents)))
        return torch.randn(len(nodes), vocab, generator=g) * 3

    return expand


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("depth", "topk", "total"), [(6, 10, 60), (3, 4, 9), (1, 5, 3), (4, 2, 100)])
def test_dynamic_tree_keeps_the_best_ancestor_closed_nodes(seed, depth, topk, total):
    calls = []
    root = torch.randn(50, generator=torch.Generator().manual_seed(100 + seed)) * 3
    grown = DynamicTree(depth, topk, total).grow(root, expander(50, seed, calls))
    n = len(grown.tokens)
    assert n == min(total, topk + (depth - 1) * topk * topk)
    d = node_depths(grown.parents)  # raises unless topological
    assert max(d) <= depth
    assert len(calls) == depth - 1 and all(len(nodes) == topk for nodes, _ in calls)
    # every expansion feeds nodes of one depth whose parents were expanded earlier
    expanded = {-1}
    for nodes, parents in calls:
        assert set(parents) <= expanded
        expanded |= set(nodes)
    # the root's top-k children are its k most likely tokens
    kids = [t for t, p in zip(grown.tokens, grown.parents) if p == -1]
    assert set(kids) <= set(root.topk(topk).indices.tolist())


def test_dynamic_tree_rerank_prefers_likely_paths():
    """A root whose top child is near-certain: the deepest chain below it must survive the rerank."""
    root = torch.full((20,), -10.0)
    root[3] = 10.0

    def expand(nodes, tokens, parents):
        out = torch.full((len(nodes), 20), -10.0)
        out[:, 5] = 10.0
        return out

    grown = DynamicTree(depth=5, topk=3, total_tokens=6).grow(root, expand)
    chain = [t for t, p in zip(grown.tokens, grown.parents)]
    assert max(node_depths(grown.parents)) == 5 and chain[0] == 3 and chain.count(5) >= 4


def test_static_tree_follows_its_paths():
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    calls = []
    grown = StaticTree(paths).grow(torch.randn(30), expander(30, 0, calls))
    assert grown.parents == sorted_paths(paths)[1] == [-1, -1, 0, 0, 1, 2]
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
    from drafters.trees import GrowingTree
    from specbench.types import TargetState
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

        def grow(self, root_logits, expand):
            def rec(nodes, tokens, parents):
                logits = expand(nodes, tokens, parents)
                seen.append((nodes, tokens, parents, logits.clone()))
                return logits
            return self.policy.grow(root_logits, rec)

    drafter.policy = Recording(drafter.policy)
    tokens = torch.tensor([[5, 17, 33, 17, 33, 9, 2, 40]])
    drafter.prefill(TargetState(tokens=tokens, hidden=None, kv=None))
    for extra in ([], [7, 8, 9]):
        tokens = torch.cat([tokens, torch.tensor([extra], dtype=torch.long)], 1)
        seen.clear()
        drafter.propose(TargetState(tokens=tokens, hidden=None, kv=None))
        assert seen and drafter.cache.get_seq_length() == tokens.shape[1]
        book, tok = GrowingTree(), {}
        for nodes, toks, parents, logits in seen:
            book.add(nodes, parents, 0)
            tok.update(zip(nodes, toks))
            for node, row in zip(nodes, logits):
                path = [tok[a] for a in reversed(book.lineage(node))]
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

    def expand(nodes, tokens, parents):
        logits = torch.randn(len(nodes), 40, generator=g) * 3
        seen.update({n: row for n, row in zip(nodes, logits)})
        return logits

    grown = policy.grow(root, expand)
    d = node_depths(grown.parents)
    assert len(grown.tokens) == 25 and max(d) == 5
    assert [d.count(k) for k in range(1, 6)] == [4, 8, 8, 3, 2]
    # the authors' convention: path p's token is the rank-p[-1] token of its parent's draft distribution
    for i, p in enumerate(policy.paths):
        parent_logits = root if grown.parents[i] == -1 else seen[grown.parents[i]]
        assert grown.tokens[i] == parent_logits.topk(4).indices[p[-1]].item()
        assert p[:-1] == (policy.paths[grown.parents[i]] if grown.parents[i] >= 0 else [])


# each paper experiment's tree for its tree drafters (conf/experiment/*.yaml; depth as DynamicTree counts it)
PAPER_TREES = {
    "beagle_table1": {"kind": "dynamic", "depth": 6, "topk": 10, "total_tokens": 60},  # papers/000 Sec. 5.1
    "coral_table2": {"kind": "dynamic", "depth": 6, "topk": 10, "total_tokens": 60},  # papers/003 Sec. 4.1
    "moa_table2": {"kind": "dynamic", "depth": 6, "topk": 8, "total_tokens": 62},  # papers/002 Sec. 4
}


@pytest.mark.parametrize("experiment", sorted(PAPER_TREES))
def test_each_experiment_decodes_with_its_papers_tree(experiment):
    """Every dynamic-tree drafter of the sweep composes the paper's tree; eagle keeps EAGLE-1's static tree (the
    experiment's dynamic settings merged into it are ignored by StaticTree); the others draft no conf/tree."""
    from hydra import compose, initialize_config_dir

    from specbench.config import register_schema

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
                assert (policy.depth, policy.topk, policy.total) == (tree["depth"], tree["topk"], tree["total_tokens"])
            else:
                assert drafter in ("none", "pld", "sd", "medusa"), drafter
