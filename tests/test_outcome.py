"""The step's outcome decided on the device (specbench/decode/outcome.py) equals the host bookkeeping it replaced:
emitted tokens cut at EOS or the budget, the stop, and the counters' numbers, over random padded trees, acceptances,
budgets and EOS sets."""
import random

import torch

from specbench.decode.outcome import decide
from specbench.decode.tree import ancestor_matrices, is_chain, node_depths
from specbench.decode.verify import greedy_accept_rows


def _reference(tokens, parents, path, nxt, eos, left):
    """The engine's host loop before issue 77 item 2 (its _emit and _count_depths over read trees)."""
    emitted, stop = [], None
    for tok in [tokens[j] for j in path] + [nxt]:
        emitted.append(tok)
        if tok in eos:
            stop = "eos"
            break
        if len(emitted) >= left:
            stop = "max_new_tokens"
            break
    last = path[-1] if path else -1
    has_child = any(p == last for p in parents)
    return emitted, stop, has_child, is_chain(parents), max(node_depths(parents), default=0)


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    chain = rng.random() < 0.3
    parents = [i - 1 if chain else rng.randrange(-1, i) for i in range(n)]
    return [rng.randrange(vocab) for _ in range(n)], parents


def test_decide_equals_the_host_bookkeeping():
    rng = random.Random(0)
    vocab = 12
    for trial in range(200):
        a = rng.randint(1, 4)
        sizes = [rng.randint(0, 7) for _ in range(a)]
        n = max(sizes)
        trees = [_random_tree(rng, k, vocab) for k in sizes]
        tokens = torch.tensor([t + [0] * (n - len(t)) for t, _ in trees], dtype=torch.long).view(a, n)
        parents = torch.tensor([p + [-1] * (n - len(p)) for _, p in trees], dtype=torch.long).view(a, n)
        valid = torch.arange(n)[None, :] < torch.tensor(sizes)[:, None]
        anc = ancestor_matrices(parents)
        # an argmax that often agrees with the drafts (long accepted paths), sometimes not
        argmax = torch.randint(vocab, (a, n + 1))
        for r in range(a):
            for i, p in enumerate(trees[r][1]):
                if rng.random() < 0.7:
                    argmax[r, p + 1] = trees[r][0][i]
        acc = greedy_accept_rows(tokens, parents, anc, argmax, valid if len(set(sizes)) > 1 else None)
        eos = sorted(rng.sample(range(vocab), rng.randint(0, 3)))
        left = [rng.randint(1, 9) for _ in range(a)]
        out = decide(acc, tokens, parents, anc.sum(-1), valid, torch.tensor(left), torch.tensor(eos, dtype=torch.long))
        read = out.read()
        paths = [p[p >= 0].tolist() for p in acc.path]
        for r in range(a):
            k = sizes[r]
            emitted, stop, has_child, chain, deepest = _reference(
                trees[r][0], trees[r][1], paths[r], int(acc.next_token[r]), set(eos), left[r])
            got = read.rows[r]
            assert (got.emitted, got.stop, got.accepted) == (emitted, stop, len(paths[r])), (trial, r)
            assert (got.recovered, got.chain, got.deepest) == (has_child, chain, deepest), (trial, r, k)
        assert read.contiguous == all(p == list(range(len(p))) for p in paths)
        assert read.staged == []
