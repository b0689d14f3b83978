"""Property tests of the tree geometry and the acceptance rules (pure functions on device tensors)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbench.decode.tree import ancestor_matrix, is_chain, node_depths, tree_attention_mask, tree_position_ids
from specbench.decode.verify import greedy_accept, rejection_accept


def T(xs):  # noqa: N802 - a list as the long tensor the engine hands over
    return torch.tensor(xs, dtype=torch.long)


def read(acc):
    """The outcome as the engine reads it: (accepted path, next token, recovered)."""
    n = int(acc.length)
    path = acc.path.tolist()
    assert all(i >= 0 for i in path[:n]) and all(i == -1 for i in path[n:])
    return path[:n], int(acc.next_token), bool(acc.recovered)


def greedy(tokens, parents, argmax):
    return read(greedy_accept(T(tokens), T(parents), ancestor_matrix(T(parents)), T(argmax)))


def sampled(tokens, parents, p, q, gen):
    return read(rejection_accept(T(tokens), T(parents), ancestor_matrix(T(parents)), p, q, gen))


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
    anc = ancestor_matrix(T(parents))
    mask = tree_attention_mask(anc, prefix, torch.float32)[0, 0]
    visible = mask == 0
    assert visible[:, :prefix].all()  # the cached prefix is visible to every row
    assert visible[0, prefix:].tolist() == [True] + [False] * len(parents)  # root sees itself only
    for i in range(len(parents)):
        seen = {c - 1 for c in range(1, len(parents) + 1) if visible[i + 1, prefix + c]}
        assert visible[i + 1, prefix]  # every node sees the root
        assert seen == ancestors_of(parents, i)
    assert torch.equal(anc, visible[:, prefix:])


@given(trees(), st.integers(0, 7))
def test_positions_are_prefix_plus_depth(tree, prefix):
    _, parents = tree
    pos = tree_position_ids(ancestor_matrix(T(parents)), prefix)[0].tolist()
    assert pos[0] == prefix
    assert pos[1:] == [prefix + d for d in node_depths(parents)]


@given(trees(), st.data())
def test_greedy_accept_is_a_matching_root_path_no_longer_than_depth(tree, data):
    tokens, parents = tree
    argmax = data.draw(st.lists(st.integers(0, 4), min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    path, next_token, recovered = greedy(tokens, parents, argmax)
    depth = max(node_depths(parents), default=0)
    assert len(path) <= depth  # emitted = path + 1 <= depth + 1
    prev = -1
    for node in path:
        assert parents[node] == prev and tokens[node] == argmax[prev + 1]
        prev = node
    assert next_token == argmax[prev + 1]
    assert recovered == (prev in parents)
    # no longer matching path exists
    ok = {}
    for i, (x, p) in enumerate(zip(tokens, parents)):
        ok[i] = (p < 0 or ok[p]) and x == argmax[p + 1]
    best = max((len(ancestors_of(parents, i)) for i in ok if ok[i]), default=0)
    assert len(path) == best
    # ties: the first node (in node order) of the deepest matching ones, as a walk in node order finds it
    if best:
        assert path[-1] == min(i for i in ok if ok[i] and len(ancestors_of(parents, i)) == best)


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
    path, next_token, _ = greedy(draft, parents, argmax)
    assert [draft[i] for i in path] + [next_token] == reference_chain_greedy(draft, argmax)


def reference_chain_sampling(draft, p, q, gen):
    """Algorithm 1 of Leviathan et al. (stops at the first rejection), its r_1..r_gamma drawn up front as the engine
    draws them (the same law as drawing each when needed)."""
    out = []
    rs = torch.rand(len(draft), generator=gen).tolist()
    for i, x in enumerate(draft):
        r = rs[i]
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
    path, next_token, _ = sampled(draft, parents, p, q, torch.Generator().manual_seed(seed + 1))
    ref = reference_chain_sampling(draft, p, q, torch.Generator().manual_seed(seed + 1))
    assert [draft[i] for i in path] + [next_token] == ref


@given(trees(), st.integers(0, 1000))
def test_rejection_accept_path_is_a_root_path(tree, seed):
    tokens, parents = tree
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(len(tokens) + 1, 5, generator=g), -1)
    path, next_token, _ = sampled(tokens, parents, p, None, g)
    prev = -1
    for node in path:
        assert parents[node] == prev
        prev = node
    assert len(path) <= max(node_depths(parents), default=0)
    assert 0 <= next_token < 5


def sequential_walk(tokens, parents, p, q, u, gen):
    """The walk as SpecInfer / EAGLE's evaluate_posterior write it, one child at a time on the host, with node i's
    uniform u[i]: the reference the device-side rejection_accept must reproduce exactly."""
    kids = [[i for i, par in enumerate(parents) if par == r - 1] for r in range(len(tokens) + 1)]
    path, row = [], 0
    while True:
        p_row, recovered = p[row], False
        for child in kids[row]:
            x = tokens[child]
            if q is None:
                a = p_row[x].item()
            else:
                qx = q[child, x].item()
                a = 1.0 if qx <= 0.0 else min(1.0, p_row[x].item() / qx)
            if u[child] < a:
                path.append(child)
                row = child + 1
                break
            if q is None:
                p_row = p_row.clone()
                p_row[x] = 0.0
            else:
                p_row = torch.clamp(p_row - q[child], min=0.0)
            p_row = p_row / p_row.sum() if p_row.sum() > 0 else p[row]
            recovered = True
        else:
            return path, int(torch.multinomial(p_row, 1, generator=gen).item()), recovered


@settings(max_examples=150)
@given(trees(max_nodes=14, vocab=4), st.integers(0, 10_000), st.booleans())
def test_rejection_accept_equals_the_sequential_walk(tree, seed, with_q):
    """The vectorised walk (per-node acceptance probabilities conditioned on earlier siblings, q = None) and the
    node-order walk (q given) against the sequential algorithm: the same path, next token and recovered flag.
    A small vocabulary makes duplicate siblings, rejections and exhausted rows frequent; float64 keeps the two
    renormalisations' round-off out of the comparison."""
    tokens, parents = tree
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(len(tokens) + 1, 4, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(len(tokens), 4, generator=g, dtype=torch.float64) * 2, -1) if with_q else None
    ours = sampled(tokens, parents, p, q, torch.Generator().manual_seed(seed + 1))
    ref_gen = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(len(tokens), generator=ref_gen, dtype=torch.float64)
    assert ours == sequential_walk(tokens, parents, p, q, u.tolist(), ref_gen)


def test_block_masks_match_their_definitions():
    """up_to_start / in_block (Beagle's windows, MoA's blocks) against the definitions written out key by key."""
    from specbench.decode.tree import in_block, up_to_start

    starts = torch.tensor([-1, 0, 0, 0, 3, 3, 5, 5])  # blocks (1..3), (4..5), (6..7)
    real = torch.tensor([[True] * 8, [True] * 6 + [False] * 2])
    got = up_to_start(starts, real)
    for b in range(2):
        for q in range(8):
            want = [(k <= starts[q] or (k == 0 and starts[q] < 0)) and (bool(real[b, k]) or starts[q] < 0 and k == 0)
                    for k in range(8)]
            assert got[b, q].tolist() == want
    for self_too in (False, True):
        got = in_block(starts, include_self=self_too)
        for q in range(8):
            assert got[q].tolist() == [starts[q] < k and (k <= q if self_too else k < q) for k in range(8)]
