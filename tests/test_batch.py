"""Batched decoding (Engine.generate_batch, issue 29): every drafter config at B = 3 on tiny random Llamas, prompts of
different lengths and rows finishing at different steps; each row equal to its prompt's greedy output and drafted as
at batch 1 (per-row drafter state), EOS inside an accepted path, one engine read per step, per-row cache compaction,
the ragged tree mask, and the target law at T>0 with B > 1."""
from collections import Counter

import pytest
import torch

from specbench.decode.engine import Engine
from specbench.decode.kvcache import PreallocatedCache, PreallocatedLayer
from specbench.tools.perf_drafters import CountedDrafter
from specbench.decode.roundtrips import HostRoundTrips
from specbench.decode.rows import Leave, RowCounts
from specbench.decode.target import compact_rows
from specbench.decode.tree import additive, ancestor_matrix, batch_tree_mask, padded_ancestors, visible
from specbench.decode.types import SamplingParams
from tests.helpers import RandomTreeDrafter, hf_greedy, tiny_llama
from tests.test_conformance import DRAFTER_CONFIGS, PROMPTS, make_drafter, target_for
from tests.test_distribution import CASES, DRAFTERS, PROMPT, chi2_pvalue, exact_law, target, tv

BUDGETS = [60, 23, 41]  # rows leave the batch at different steps


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_every_drafter_batched_is_lossless_per_row(name):
    t = target_for()
    batch = Engine(t, make_drafter(name, t), SamplingParams(), trace=True).generate_batch(PROMPTS, BUDGETS)
    single = Engine(t, make_drafter(name, t), SamplingParams(), trace=True)
    for prompt, budget, row in zip(PROMPTS, BUDGETS, batch.rows):
        assert row.new_tokens == hf_greedy(t.model, prompt, budget)
        alone = single.generate(prompt, budget)
        # each row's drafter kept its own state: the same trees accepted as at batch 1
        assert row.tokens_per_step == alone.tokens_per_step and row.tree_sizes == alone.tree_sizes
        # and drafted as alone: each step's tree shape and tokens, and the drafter's scores behind it (a dynamic tree's path
        # scores: its logits at every level), up to the rounding of a batched forward
        assert [s.parents for s in row.trace] == [s.parents for s in alone.trace]
        assert [s.tokens for s in row.trace] == [s.tokens for s in alone.trace]  # row r's proposal is its own
        for mine, own in zip(row.trace, alone.trace):
            if own.priority is not None:
                torch.testing.assert_close(torch.tensor(mine.priority), torch.tensor(own.priority), rtol=1e-4,
                                           atol=1e-4)
    assert batch.active[0] == 3 and batch.active[-1] == 1  # rows left the batch as they finished
    assert batch.steps == max(r.steps for r in batch.rows)


def test_a_row_done_at_the_prefill_leaves_before_the_first_step():
    """A row whose budget is one token is done at the prefill: the cache drops its row before the first verification
    and the other rows decode as alone (the other rows' prefixes are still ragged)."""
    t = target_for()
    for name in ("none", "eagle2", "moa", "sd"):
        rows = Engine(t, make_drafter(name, t), SamplingParams()).generate_batch(PROMPTS, [23, 1, 41]).rows
        assert [r.new_tokens for r in rows] == [hf_greedy(t.model, p, n) for p, n in zip(PROMPTS, [23, 1, 41])]
        assert rows[1].steps == 0


def test_a_row_at_the_context_limit_does_not_regrow_the_cache(monkeypatch):
    """With a context bound, a row near its end still writes the step's widest padded tree (another row's 59-node
    tree): the cache is sized for it, so nothing is reallocated mid-turn, and each row stops where it stops alone."""
    t = target_for()
    context = len(PROMPTS[1]) + 60  # room for a 59-node tree behind the shortest prompt, soon none behind the longest
    budgets = [context - len(p) for p in PROMPTS]  # every row runs up to the context's last position

    def regrow(self, need):
        raise AssertionError(f"cache reallocated to {need} positions")
    monkeypatch.setattr(PreallocatedLayer, "_grow", regrow)
    engine = Engine(t, make_drafter("eagle2", t), SamplingParams())
    rows = engine.generate_batch(PROMPTS, budgets, context=context).rows
    for prompt, n, row in zip(PROMPTS, budgets, rows):
        alone = engine.generate(prompt, n, context=context)
        assert row.new_tokens == alone.new_tokens == hf_greedy(t.model, prompt, n)
        assert row.tree_sizes == alone.tree_sizes  # the same trees dropped at the context's end


def test_batch_of_one_is_generate():
    t = target_for()
    for name in ("none", "eagle2", "sd"):
        one = Engine(t, make_drafter(name, t), SamplingParams()).generate_batch(PROMPTS[:1], 30).rows[0]
        ref = Engine(t, make_drafter(name, t), SamplingParams()).generate(PROMPTS[0], 30)
        assert (one.new_tokens, one.tokens_per_step, one.tree_sizes) == (ref.new_tokens, ref.tokens_per_step,
                                                                          ref.tree_sizes)


def test_capture_at_takes_each_rows_choosing_logits():
    """generate_batch(capture_at={row: k}): the logits row that chose row's new token k (the divergence replay of a
    batched turn), as generate(capture_at=k) takes it at batch 1."""
    t = target_for()
    for name in ("none", "eagle2"):
        engine = Engine(t, make_drafter(name, t), SamplingParams())
        for row, k in ((0, 0), (1, 5), (2, 17)):
            got = engine.generate_batch(PROMPTS, BUDGETS, capture_at={row: k}).rows
            assert all(g.captured is None for i, g in enumerate(got) if i != row)
            alone = engine.generate(PROMPTS[row], BUDGETS[row], capture_at=k).captured
            assert int(got[row].captured.argmax()) == got[row].new_tokens[k] == int(alone.argmax())
            torch.testing.assert_close(got[row].captured.float(), alone.float(), rtol=1e-4, atol=1e-4)


def eos_target() -> tuple:
    """A tiny target whose EOS is a token its greedy output for PROMPTS[0] reaches at position k >= 8."""
    free = hf_greedy(target_for().model, PROMPTS[0], 40)
    k = next(i for i in range(8, 40) if free[i] not in free[:i])
    return target_for(eos=free[k]), free, k


def test_eos_inside_an_accepted_path_ends_only_its_row():
    t, free, k = eos_target()
    refs = [hf_greedy(t.model, p, 40) for p in PROMPTS]
    inside = []
    for seed in range(1, 9):
        batch = Engine(t, RandomTreeDrafter(128, free, seed=seed), SamplingParams(), trace=True).generate_batch(
            PROMPTS, 40)
        assert [r.new_tokens for r in batch.rows] == refs
        row = batch.rows[0]
        assert row.new_tokens == free[: k + 1] and row.stopped_by == "eos"
        # the EOS was an accepted drafted node (not the bonus token) when the last step emitted no more tokens than
        # its accepted path holds
        inside.append(row.tokens_per_step[-1] <= len(row.trace[-1].path))
    assert any(inside)


def accepted_first_use(name: str) -> tuple[int, list[list[int]], int, int, list[int]]:
    """(target seed, prompts, row, k, the row's new tokens): a batch on target_for(seed) whose row's new token k is an
    accepted drafted node (not a bonus or recovered token) and the row's first use of that token, found by decoding
    without an EOS. Untrained drafters get few nodes accepted, but on these sharp tiny targets every config gets some;
    the third prompt repeats a prompt after its own greedy continuation, so that `pld`'s lookup (which copies the
    context) can propose a token before the output has used it."""
    for seed in range(3):
        t = target_for(seed=seed)
        prompts = PROMPTS[:2] + [PROMPTS[1] + hf_greedy(t.model, PROMPTS[1], 16) + PROMPTS[1]]
        batch = Engine(t, make_drafter(name, t), SamplingParams(), trace=True).generate_batch(prompts, 40)
        for r, row in enumerate(batch.rows):
            at = len(row.new_tokens) - sum(row.tokens_per_step)  # the prefill's token
            for emitted, step in zip(row.tokens_per_step, row.trace):
                for k in range(at, at + min(len(step.path), emitted)):
                    if row.new_tokens[k] not in row.new_tokens[:k]:
                        return seed, prompts, r, k, row.new_tokens
                at += emitted
    raise AssertionError(f"{name}: no accepted drafted token to make the EOS")


@pytest.mark.parametrize("name", [n for n in DRAFTER_CONFIGS if n != "none"])
def test_every_drafter_batched_stops_a_row_at_an_eos_inside_its_accepted_path(name):
    """Each drafter config (its own trees, its own batched state): the EOS is a token the drafter proposed and
    verification accepted, so the row stops inside an accepted path, mid-step, and leaves the batch while the others
    go on; every row equals the target's greedy output with that EOS."""
    seed, prompts, r, k, free = accepted_first_use(name)
    t = target_for(eos=free[k], seed=seed)
    batch = Engine(t, make_drafter(name, t), SamplingParams(), trace=True).generate_batch(prompts, 40)
    assert [row.new_tokens for row in batch.rows] == [hf_greedy(t.model, p, 40) for p in prompts]
    row = batch.rows[r]
    assert row.new_tokens == free[: k + 1] and row.stopped_by == "eos"
    # the step that emitted the EOS emitted no more tokens than its accepted path holds: the EOS was a drafted node
    assert row.tokens_per_step[-1] <= len(row.trace[-1].path)


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_one_engine_read_per_step(name):
    """The engine reads the whole batch's outcome with one transfer per step (rows leaving the batch cost one copy of
    their index to the device); a batched drafter (every row in the same calls) reads per step what it reads per step
    for one row, whatever B: none of its own since issue 77 (pld's counts travel in the engine's read, coral_router
    routes on the device). Every drafter config is batched."""
    t = target_for()
    engine = Engine(t, make_drafter(name, t), SamplingParams())
    engine.generate_batch(PROMPTS, 20)
    with HostRoundTrips() as prefill_only:
        engine.generate_batch(PROMPTS, 1)
    inner, engine.drafter = engine.drafter, CountedDrafter(engine.drafter)
    with HostRoundTrips() as whole:
        g = engine.generate_batch(PROMPTS, 20)
    drafters_reads = engine.drafter.rt.total
    engine_reads = whole.total - prefill_only.total - drafters_reads
    left = sum(1 for a, b in zip(g.active, g.active[1:]) if b < a)  # steps after which rows left
    assert engine_reads == g.steps + left, (name, g.steps, left, whole.counts)
    per_step = 0.0
    for prompt in PROMPTS:
        engine.drafter = CountedDrafter(inner)
        one = engine.generate(prompt, 20)
        per_step = max(per_step, engine.drafter.rt.total / one.steps)
    engine.drafter = inner
    assert inner.batched
    # every row drafted in the same calls: a step reads what one row's step reads, whatever B
    assert drafters_reads <= g.steps * per_step, (name, drafters_reads, g.steps, per_step)


def test_a_one_row_drafter_decodes_at_batch_1_and_is_refused_at_batch_3_in_one_line():
    from specbench.errors import SpecbenchError
    from tests.test_conformance import Probe

    t = target_for()
    ref = hf_greedy(t.model, PROMPTS[0], 20)
    probe = Probe(128, ref, seed=0)
    assert Engine(t, probe, SamplingParams()).generate_batch(PROMPTS[:1], 20).rows[0].new_tokens == ref
    assert probe.seen and all(hidden is not None for _, hidden, _, _ in probe.seen)  # OneRow hands the hidden rows
    with pytest.raises(SpecbenchError, match="drafts one row at a time.*batch_size=3"):
        Engine(t, Probe(128, ref, seed=0), SamplingParams()).generate_batch(PROMPTS, 20)


def test_ragged_mask_rows_see_their_own_prefix_and_tree():
    ancs = [ancestor_matrix(torch.tensor([-1, 0, -1])), ancestor_matrix(torch.tensor([-1]))]
    mask = batch_tree_mask(torch.stack([padded_ancestors(a, 4) for a in ancs]), torch.tensor([5, 2]), 9, torch.float32)
    assert mask.shape == (2, 1, 4, 9)
    allowed = mask == 0
    assert torch.equal(allowed[0, 0], visible(ancs[0], 5)[0, 0])  # the longest row: as a lone tree forward
    # the other: its 2 entries, its root and node at columns 2, 3, never the stale columns; a padding row: the
    # prefix and itself (its outputs are never read)
    assert allowed[1, 0, 0].tolist() == [True, True, True, False, False, False, False, False, False]
    assert allowed[1, 0, 1].tolist() == [True, True, True, True, False, False, False, False, False]
    assert allowed[1, 0, 3].tolist() == [True, True, False, False, False, True, False, False, False]
    assert torch.equal(additive(allowed, torch.float32), mask)


def test_compact_rows_keeps_each_rows_accepted_entries():
    cache = PreallocatedCache(tiny_llama(layers=2).config, 32)
    layer = cache.layers[0]
    k = torch.arange(2 * 2 * 10 * 8, dtype=torch.float32).reshape(2, 2, 10, 8)
    kv = {i: (k + 1000 * i, -k - 1000 * i) for i in range(len(cache.layers))}  # every layer's K and V its own
    for i, lay in enumerate(cache.layers):
        lay.update(kv[i][0][:, :, :4], kv[i][1][:, :, :4])
    cache.set_row_lengths([4, 2])  # ragged: row 1 holds 2 entries
    for i, lay in enumerate(cache.layers):  # each row writes a root and 3 nodes behind its own entries
        lay.update(kv[i][0][:, :, 4:8], kv[i][1][:, :, 4:8])
    assert layer.rows.host == (8, 6) and layer.rows.dev.tolist() == [8, 6]
    # row 0 (root at 4) keeps nodes 1, 2 (entries 6, 7 -> 5, 6); row 1 (root at 2) keeps node 0 (entry 3: in place)
    compact_rows(cache, RowCounts.copy([5, 3], None), torch.tensor([[1, 2, -1], [0, -1, -1]]),
                 RowCounts.copy([2, 1], None))
    assert cache.row_lengths() == [7, 4]
    for i, lay in enumerate(cache.layers):
        for got, want in ((lay.keys, kv[i][0]), (lay.values, kv[i][1])):
            assert torch.equal(got[0, :, 5:7], want[0, :, 6:8]) and torch.equal(got[1, :, 2:4], want[1, :, 4:6])
            assert torch.equal(got[0, :, :5], want[0, :, :5])  # the prefix and root untouched
    cache.leave(torch.tensor([1]), torch.tensor([0]), 1, [4])  # row 0 left the batch: row 1 takes its place
    assert cache.row_lengths() == [4] and layer._k.shape[0] == 1
    for i, lay in enumerate(cache.layers):
        assert torch.equal(lay.keys[0, :, 2:4], kv[i][0][1, :, 4:6]) and torch.equal(lay.values[0, :, 2:4], kv[i][1][1, :, 4:6])


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-T{p.temperature:g}-k{p.top_k}" for n, p in CASES])
def test_batched_samples_follow_the_target_law(name, params):
    """T>0, B = 3: every row of every batch is a sample of the target law (the rows' generators independent), for
    every case of tests/test_distribution.py (each drafter kind at T=1; top-k / top-p warping)."""
    t = target()
    law = exact_law(t, params)
    eng = Engine(t, DRAFTERS[name](t), params)

    def draw(batches: int, seed: int) -> Counter:
        out: Counter = Counter()
        for i in range(batches):
            gens = [torch.Generator().manual_seed(seed * 1_000_003 + 3 * i + r) for r in range(3)]
            for row in eng.generate_batch([PROMPT, PROMPT[1:], PROMPT], 3, gens).rows[::2]:  # rows of PROMPT
                out[(row.new_tokens[1], row.new_tokens[2])] += 1
        return out

    small, big = draw(60, 1), draw(400, 2)
    assert chi2_pvalue(big, law, 800) > 1e-3
    assert tv(big, law, 800) < tv(small, law, 120)


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_every_drafter_config_samples_each_row_as_alone(name):
    """T>0, every conf/drafter config (its own tree, untrained weights): row r of a batch draws, from row r's
    generator, exactly the tokens its prompt draws alone from the same seed. With each drafter class's law at batch 1
    (tests/test_distribution.py) and at B = 3 (above), this puts every config's rows under the target law at B > 1."""
    params = SamplingParams(temperature=1.0)
    t = target()
    small_vocab = {"coral_router": ("drafter.module.groups=4",)}  # the router's 16 groups need a vocabulary of 16
    eng = Engine(t, make_drafter(name, t, *small_vocab.get(name, ())), params)
    prompts = [PROMPT, PROMPT[1:], PROMPT + PROMPT]
    drafted = 0
    for i in range(3):
        seeds = [10 * i + r for r in range(3)]
        batch = eng.generate_batch(prompts, 8, [torch.Generator().manual_seed(s) for s in seeds])
        alone = [eng.generate(p, 8, torch.Generator().manual_seed(s)).new_tokens for p, s in zip(prompts, seeds)]
        assert [r.new_tokens for r in batch.rows] == alone
        drafted += sum(sum(r.tree_sizes) for r in batch.rows)
    assert drafted > 0 or name == "none"  # the rows' trees were verified, not skipped


# ---- the rows protocol and the batched step pieces -------------------------------------------------------------------
def test_swap_remove_moves_only_rows_above_the_new_size():
    from specbench.decode.rows import swap_remove

    assert swap_remove(5, {1}) == [0, 4, 2, 3]  # the last row takes the hole; the others stay
    assert swap_remove(5, {1, 4}) == [0, 3, 2]
    assert swap_remove(4, {2, 3}) == [0, 1]  # nothing moves
    assert swap_remove(3, {0, 1, 2}) == []


def test_ancestor_matrices_are_each_trees_own():
    from specbench.decode.tree import ancestor_matrices

    trees = [[-1, 0, 0, 1, 3], [-1, -1, 1, 2, -1], [-1, 0, 1, 2, 3]]
    anc = ancestor_matrices(torch.tensor(trees))
    for a, parents in zip(anc, trees):
        assert torch.equal(a, ancestor_matrix(torch.tensor(parents)))


def test_greedy_rows_with_padding_decide_as_each_row_alone():
    """Rows padded to one node count (padding: children of the root, token 0, the target's choice there too) accept
    what each row accepts alone: a padding node is never accepted nor counted as a rejected child."""
    from specbench.decode.tree import ancestor_matrices
    from specbench.decode.verify import greedy_accept, greedy_accept_rows

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        sizes = torch.randint(0, 6, (3,), generator=g).tolist()
        n = max(sizes)
        rows = []
        for k in sizes:
            parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(k)]
            tokens = torch.randint(0, 3, (k,), generator=g).tolist()
            argmax = torch.randint(0, 3, (k + 1,), generator=g).tolist()
            rows.append((tokens, parents, argmax))
        tok = torch.tensor([t + [0] * (n - len(t)) for t, _, _ in rows])
        par = torch.tensor([p + [-1] * (n - len(p)) for _, p, _ in rows])
        am = torch.tensor([a + [0] * (n - len(a) + 1) for _, _, a in rows])
        am[:, 0] = torch.where(torch.rand(3, generator=g) < 0.5, 0, am[:, 0])  # padding tokens often right too
        valid = torch.arange(n)[None] < torch.tensor(sizes)[:, None]
        acc = greedy_accept_rows(tok, par, ancestor_matrices(par), am, valid)
        for r, (t, p, _) in enumerate(rows):
            k = len(t)
            alone = greedy_accept(torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long),
                                  ancestor_matrix(torch.tensor(p, dtype=torch.long)), am[r, : k + 1])
            length = int(acc.length[r])
            assert length == int(alone.length)
            assert acc.path[r, :length].tolist() == alone.path[:length].tolist()
            assert int(acc.next_token[r]) == int(alone.next_token) and bool(acc.recovered[r]) == bool(alone.recovered)


@pytest.mark.parametrize("name", ["none", "pld"])
def test_a_batched_drafters_rows_are_each_rows_own_proposal(name):
    """A drafter that drafts every row at once (batched = True) proposes for row r what it proposes for that row
    alone: ragged rows, the padding past each row's length ignored."""
    from specbench.decode.types import TargetState

    t = target_for()
    drafter = make_drafter(name, t)
    assert drafter.batched
    contexts = [[5, 17, 33, 17, 33, 9, 2, 17, 33], [1, 2, 3, 1, 2], [60, 61, 60, 61, 60, 7], [4, 4, 4, 4, 4, 4, 4, 4]]
    width = max(len(c) for c in contexts)
    tokens = torch.tensor([c + [c[-1]] * (width - len(c)) for c in contexts])
    state = TargetState(tokens=tokens, hidden=None, kv=None, lengths=RowCounts.copy([len(c) for c in contexts], None))
    tree = drafter.propose_rows(state)
    for r, c in enumerate(contexts):
        alone = drafter.propose(TargetState(tokens=torch.tensor([c]), hidden=None, kv=None))
        mine = tree.row(r)
        assert mine.tokens.tolist() == alone.tokens.tolist() and mine.parents.tolist() == alone.parents.tolist()


def test_row_counts_change_on_both_sides_together():
    """RowCounts: arithmetic, clamping and a leave give the same counts on the host and on the device; counts of
    different row numbers are refused."""
    a, b = RowCounts.copy([4, 2, 7], None), RowCounts.copy([1, 3, 0], None)
    for got, want in ((a + b, [5, 5, 7]), (a - b, [3, -1, 7]), (a + 2, [6, 4, 9]), ((a - b).clamp(min=0, max=5),
                                                                                    [3, 0, 5])):
        assert list(got) == want and got.dev.tolist() == want
    assert a.max() == 7 and a.ragged and not RowCounts.copy([3, 3], None).ragged
    leave = Leave([2, 1], torch.tensor([2, 1]), torch.tensor([2]), torch.tensor([0]))
    kept = a.keep(leave)
    assert kept.host == (7, 2) and kept.dev.tolist() == [7, 2]
    with pytest.raises(ValueError):
        a + RowCounts.copy([1, 2], None)
