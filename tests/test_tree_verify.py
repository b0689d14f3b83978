"""Property tests of the tree geometry and the acceptance rules (pure functions)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbench.tree import ancestor_matrix, is_chain, node_depths, tree_attention_mask, tree_position_ids
from specbench.verify import greedy_accept, rejection_accept


@st.composite
def trees(draw, max_nodes=12, vocab=5):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return tokens, parents


def ancestors_of(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@given(trees(), st.integers(0, 7))
def test_mask_lets_each_node_see_exactly_prefix_root_and_ancestors(tree, prefix):
    _, parents = tree
    mask = tree_attention_mask(parents, prefix, torch.float32, "cpu")[0, 0]
    visible = mask == 0
    assert visible[:, :prefix].all()  # the cached prefix is visible to every row
    assert visible[0, prefix:].tolist() == [True] + [False] * len(parents)  # root sees itself only
    for i in range(len(parents)):
        seen = {c - 1 for c in range(1, len(parents) + 1) if visible[i + 1, prefix + c]}
        assert visible[i + 1, prefix]  # every node sees the root
        assert seen == ancestors_of(parents, i)
    assert torch.equal(ancestor_matrix(parents), visible[:, prefix:])


@given(trees(), st.integers(0, 7))
def test_positions_are_prefix_plus_depth(tree, prefix):
    _, parents = tree
    pos = tree_position_ids(parents, prefix, "cpu")[0].tolist()
    assert pos[0] == prefix
    assert pos[1:] == [prefix + d for d in node_depths(parents)]


@given(trees(), st.data())
def test_greedy_accept_is_a_matching_root_path_no_longer_than_depth(tree, data):
    tokens, parents = tree
    argmax = data.draw(st.lists(st.integers(0, 4), min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    acc = greedy_accept(tokens, parents, argmax)
    depth = max(node_depths(parents), default=0)
    assert len(acc.path) <= depth  # emitted = path + 1 <= depth + 1
    prev = -1
    for node in acc.path:
        assert parents[node] == prev and tokens[node] == argmax[prev + 1]
        prev = node
    assert acc.next_token == argmax[prev + 1]
    # no longer matching path exists
    ok = {}
    for i, (x, p) in enumerate(zip(tokens, parents)):
        ok[i] = (p < 0 or ok[p]) and x == argmax[p + 1]
    best = max((len(ancestors_of(parents, i)) for i in ok if ok[i]), default=0)
    assert len(acc.path) == best


def reference_chain_greedy(draft, argmax):
    """Leviathan's Algorithm 1 at T=0: accept while x_i == argmax p_i, then emit argmax p_{n+1}."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return draft[:n] + [argmax[n]]


@given(st.lists(st.integers(0, 4), max_size=10), st.data())
def test_chain_greedy_equals_reference(draft, data):
    argmax = data.draw(st.lists(st.integers(0, 4), min_size=len(draft) + 1, max_size=len(draft) + 1))
    parents = list(range(-1, len(draft) - 1))
    assert is_chain(parents)
    acc = greedy_accept(draft, parents, argmax)
    assert [draft[i] for i in acc.path] + [acc.next_token] == reference_chain_greedy(draft, argmax)


def reference_chain_sampling(draft, p, q, gen):
    """Algorithm 1 of Leviathan et al., drawing r_i sequentially (stops at the first rejection)."""
    out = []
    for i, x in enumerate(draft):
        r = torch.rand((), generator=gen).item()
        qx = q[i, x].item()
        if r < (1.0 if qx <= 0 else min(1.0, p[i, x].item() / qx)):
            out.append(x)
            continue
        resid = torch.clamp(p[i] - q[i], min=0)
        resid = resid / resid.sum() if resid.sum() > 0 else p[i]
        return out + [int(torch.multinomial(resid, 1, generator=gen).item())]
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=gen).item())]


@settings(max_examples=60)
@given(st.integers(0, 6), st.integers(0, 10_000))
def test_chain_sampling_equals_algorithm_1(gamma, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(gamma + 1, 6, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(gamma, 6, generator=g) * 2, -1)
    draft = [int(torch.multinomial(q[i], 1, generator=g).item()) for i in range(gamma)]
    parents = list(range(-1, gamma - 1))
    acc = rejection_accept(draft, parents, p, q, torch.Generator().manual_seed(seed + 1))
    ref = reference_chain_sampling(draft, p, q, torch.Generator().manual_seed(seed + 1))
    assert [draft[i] for i in acc.path] + [acc.next_token] == ref


@given(trees(), st.integers(0, 1000))
def test_rejection_accept_path_is_a_root_path(tree, seed):
    tokens, parents = tree
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(len(tokens) + 1, 5, generator=g), -1)
    acc = rejection_accept(tokens, parents, p, None, g)
    prev = -1
    for node in acc.path:
        assert parents[node] == prev
        prev = node
    assert len(acc.path) <= max(node_depths(parents), default=0)
    assert 0 <= acc.next_token < 5
