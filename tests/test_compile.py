"""model.compile (issue 30): the target's tree forwards, and the drafters' decoders (EAGLE's head, sd's draft model),
through torch.compile over static caches, trees padded to buckets. Every drafter config decodes its greedy output through it (with dynamo's aot_eager backend: the same graph
capture, static shapes and guards as inductor, without its C++ build; one inductor case), nothing recompiles once the
buckets are warm, and the static cache refuses what it cannot hold."""
import pytest
import torch
from omegaconf import OmegaConf

from specbench.decode.draftcache import DraftCache
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.decode.kvcache import StaticCache
from specbench.bench.run import Runner
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams, TargetState
from tests.helpers import hf_greedy, tiny_llama
from tests.test_conformance import CONF, DRAFTER_CONFIGS, PROMPTS, make_drafter, target_for


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def compiled():
    """One compiled target for the module: its graphs (one per tree bucket) are built once."""
    return TargetModel(tiny_llama(seed=0, scale=20.0), None, torch.device("cpu"), "tiny", compile="aot_eager")


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_every_drafter_decodes_its_greedy_output_compiled(compiled, name):
    drafter = make_drafter(name, compiled)
    for prompt in PROMPTS[:2]:
        out = Engine(compiled, drafter, SamplingParams()).generate(prompt, 40)
        assert out.new_tokens == hf_greedy(compiled.model, prompt, 40)
    assert isinstance(compiled.new_cache(64), StaticCache)


def test_nothing_recompiles_once_the_buckets_are_warm(compiled, monkeypatch):
    """After one generation, the baseline (one token a step: bucket 1 at every length) decodes other prompts without a
    recompile: no graph per length. sd's buckets (its chain on the target, its draft model's catch-up, as long as its
    last acceptance) are warm once the prompts were decoded, and their replay recompiles nothing (the Runner's warm
    pass). The steps ran through the compiled graphs, not the eager fallback, where error_on_recompile would have
    nothing to catch."""
    calls = []
    step = compiled.compiled.step
    monkeypatch.setattr(compiled.compiled, "step", lambda *a: calls.append(1) or step(*a))
    none, sd = (Engine(compiled, make_drafter(n, compiled), SamplingParams()) for n in ("none", "sd"))
    none.generate(PROMPTS[0], 30)
    for prompt in PROMPTS:
        sd.generate(prompt, 30)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for engine, prompts in ((none, PROMPTS[1:]), (sd, PROMPTS)):
            for prompt in prompts:
                calls.clear()
                assert engine.generate(prompt, 30).new_tokens == hf_greedy(compiled.model, prompt, 30)
                assert len(calls) > 1  # every step after the (eager) prefill


def own_cache(drafter):
    """A drafter's own cache (EAGLE's: the one its DraftCache keeps; None: it has none)."""
    cache = getattr(drafter, "cache", None)
    return cache.cache if isinstance(cache, DraftCache) else cache


@pytest.mark.parametrize("name", ["eagle2", "sd_tree"])
def test_the_drafters_decoders_run_compiled_on_their_own_static_caches(compiled, name):
    """EAGLE's head (eagle, eagle2, hass, coral) and sd's draft model run through their own compiled decoder, on a
    static cache of their own: its graphs are warm after one pass, so a second pass over the same prompts (tokens
    sliced from a longer sequence: strides that differ) recompiles nothing and decodes the same tokens."""
    engine = Engine(compiled, make_drafter(name, compiled), SamplingParams())
    first = [engine.generate(p, 30).new_tokens for p in PROMPTS[:2]]
    cache = own_cache(engine.drafter)
    assert isinstance(cache, StaticCache) and cache is not compiled.new_cache(64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert [engine.generate(p, 30).new_tokens for p in PROMPTS[:2]] == first


def test_inductor_compiles_the_baseline():
    """The default backend (inductor: generated C++ here, Triton and CUDA graphs on a GPU) on the baseline."""
    target = TargetModel(tiny_llama(seed=1, layers=2, scale=20.0), None, torch.device("cpu"), "tiny", compile=True)
    out = Engine(target, make_drafter("none", target), SamplingParams()).generate(PROMPTS[1], 12)
    assert out.new_tokens == hf_greedy(target.model, PROMPTS[1], 12)


def test_the_static_cache_refuses_what_it_cannot_hold():
    cache = StaticCache(tiny_llama(layers=2).config, 8, torch.device("cpu"))
    with pytest.raises(SpecbenchError, match="9 positions exceed the static cache's 8"):
        cache.begin(9)
    cache.begin(1, live=1)
    with pytest.raises(SpecbenchError, match="2 rows on a static cache of 1"):
        cache.begin(1, live=2)


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_every_drafter_decodes_a_batch_compiled(compiled, name, monkeypatch):
    """model.compile at B > 1: ragged prompts on the static cache of the batch's bucket (3 rows in a bucket of 4, the
    fourth padding), rows finishing at different steps (a finished row leaves; the buffers keep their bucket): every
    row its greedy output, every step after the prefill through the compiled graphs at the bucket's shape."""
    shapes = []
    step = compiled.compiled.step
    monkeypatch.setattr(compiled.compiled, "step",
                        lambda ids, embeds, *a: shapes.append((ids if ids is not None else embeds).shape[0])
                        or step(ids, embeds, *a))
    budgets = [20, 12, 24]
    drafter = make_drafter(name, compiled)
    out = Engine(compiled, drafter, SamplingParams()).generate_batch(PROMPTS[:3], budgets)
    assert [g.new_tokens for g in out.rows] == [hf_greedy(compiled.model, p, n) for p, n in zip(PROMPTS, budgets)]
    assert len(shapes) >= max(g.steps for g in out.rows) and set(shapes) == {4}
    own = own_cache(drafter)  # EAGLE's head, sd's draft model: their own static caches, bucket 4
    assert not isinstance(own, StaticCache) or own.batch == 4
    if name in ("eagle2", "sd"):
        assert isinstance(own, StaticCache)


@pytest.mark.parametrize("routing", ["grouped", "masked"])
def test_coral_routers_tree_grows_in_the_compiled_region(compiled, routing, monkeypatch):
    """coral_router's routings have no host read (`grouped`: the active groups' rows in one grouped matmul, its group
    sizes on the device; `masked`: the whole head), so either grows the tree in the one compiled region, as eagle's:
    lossless at B = 1 and B = 3, and the warm graphs recompile nothing."""
    drafter = make_drafter("coral_router", compiled, f"drafter.module.routing={routing}")
    assert drafter.head.router.routing == routing
    grows = []
    grow = drafter.region.grow
    monkeypatch.setattr(drafter.region, "grow", lambda *a: grows.append(1) or grow(*a))
    engine = Engine(compiled, drafter, SamplingParams())
    assert engine.generate(PROMPTS[0], 30).new_tokens == hf_greedy(compiled.model, PROMPTS[0], 30)
    out = engine.generate_batch(PROMPTS[:3], 24)
    assert [g.new_tokens for g in out.rows] == [hf_greedy(compiled.model, p, 24) for p in PROMPTS[:3]]
    assert len(grows) >= max(g.steps for g in out.rows)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_batch(PROMPTS[:3][::-1], 24)
    assert [g.new_tokens for g in out.rows] == [hf_greedy(compiled.model, p, 24) for p in PROMPTS[:3][::-1]]


def test_a_batch_recompiles_nothing_once_warm(compiled):
    """After one batch of 3 (bucket 4; rows leaving at different steps), other prompts in a batch of 3 and a last
    batch of 2 (padded into the same bucket) decode through the same graphs; batch 1 keeps a cache of its own."""
    engine = Engine(compiled, make_drafter("none", compiled), SamplingParams())
    engine.generate_batch(PROMPTS, [6, 3, 9])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts in (PROMPTS[::-1], PROMPTS[1:]):
            out = engine.generate_batch(prompts, [9, 5, 7][: len(prompts)])
            assert [g.new_tokens for g in out.rows] == [hf_greedy(compiled.model, p, n)
                                                        for p, n in zip(prompts, [9, 5, 7])]
    batch_cache = compiled.new_cache(64, batch=2)
    assert batch_cache.batch == 4 and compiled.new_cache(64).batch == 1
    assert compiled.new_cache(64, batch=3) is batch_cache  # (a one-row generation between batches keeps it)


def test_compiled_batches_run_through_the_runner(make_cfg, monkeypatch):
    """decoding.batch_size > 1 with model.compile=true (no longer refused): the drafter's and its baseline's records
    equal the eager batch-1 run's, token for token (aot_eager in place of inductor)."""
    import specbench.decode.compiled as compiled_module

    build = compiled_module.torch_compile
    monkeypatch.setattr(compiled_module, "torch_compile", lambda fn, device, backend: build(fn, device, "aot_eager"))
    common = ("drafter=pld", "dataset.limit=2", "decoding.max_new_tokens=8")

    def tokens(*extra):
        cfg = make_cfg(*common, *extra)
        runner = Runner(cfg)
        runner.execute()
        dirs = [runner.run_dir_for(node)[0] for node in (cfg.drafter, OmegaConf.load(CONF / "none.yaml"))]
        return [{(r["question_id"], r["turn"]): r["new_token_ids"] for r in d.records()} for d in dirs]

    eager = tokens("out.experiment=eager")
    assert eager[0] == eager[1]
    assert tokens("out.experiment=batch", "model.compile=true", "decoding.batch_size=2") == eager


@pytest.mark.parametrize("name", ["eagle2", "sd"])
def test_a_batch_of_one_decodes_compiled_on_static_caches(compiled, name):
    """Compiled, batch 1 (the batch's path, as every B): the target on the static cache, the drafter's decoder on
    its own static cache, the greedy output."""
    engine = Engine(compiled, make_drafter(name, compiled), SamplingParams())
    assert engine.generate(PROMPTS[1], 20).new_tokens == hf_greedy(compiled.model, PROMPTS[1], 20)
    assert isinstance(own_cache(engine.drafter), StaticCache)


def test_a_drafters_static_cache_holds_what_the_targets_holds(compiled):
    """A static cache cannot grow: a drafter's (asked for its prompt + 1024 positions) is at least as large as the
    target's, which is sized to the generation (here 1500 new tokens: past the drafter's own ask)."""
    engine = Engine(compiled, make_drafter("sd", compiled), SamplingParams())
    engine.generate(PROMPTS[0], 2)
    small = own_cache(engine.drafter).capacity
    compiled.new_cache(len(PROMPTS[0]) + 1500)
    engine.drafter.prefill(TargetState(tokens=torch.tensor([PROMPTS[0]]), hidden=None, kv=None))
    assert own_cache(engine.drafter).capacity >= compiled.compiled.capacity > small


@pytest.mark.parametrize("name,batch,graphs", [("eagle2", 1, 2), ("eagle2", 3, 2), ("eagle", 1, 2), ("sd_tree", 3, 2),
                                               ("eagle3", 3, 2), ("beagle", 1, 2), ("beagle", 3, 2), ("moa_tli1", 1, 2),
                                               ("moa", 3, 2), ("coral_router", 1, 2), ("coral_router", 3, 2)])
def test_a_draft_tree_grows_in_one_compiled_region(compiled, name, batch, graphs, monkeypatch):
    """Issue 48, item 4: with model.compile, EAGLE-2's propose is two graph replays (the head's forward over the
    verified pairs, then the whole tree: every level's forward, LM head, top-k, scores and gathers) with a few dozen
    eager operators around them (padding, the write offsets: 50 at batch 1 and 77 at batch 3 when written), where
    growing the levels eagerly between compiled decoder calls ran ~475 at batch 1 and ~600 at batch 3 (counted at
    aa18331 with this test's profiler). sd_tree the same (its draft model's catch-up, then the tree: 98 at batch 3,
    553 before); eagle3 too (its step over the verified pairs on a static K, V, then the tree: 43 at batch 3, 934
    before, when nothing of it was compiled). eagle: EAGLE-1's static tree, whose index tensors are made before the
    region (as its outputs, a CUDA graph's next replay would overwrite them; here: a recompile). beagle: the append of
    the new true states' K, V, then the tree (27 at batch 1 and 32 at batch 3 when written, 939 and 1088 before).
    moa and moa_tli1: two replays, the step over the new verified tokens (their activations: LSA, CA keys, TLI copies;
    their SA entries), then the tree (moa: 55 at batch 1, 62 at batch 3 with three regions, the step then two; 1360
    and 1575 before any)."""
    import specbench.decode.compiled as compiled_module
    from torch._dynamo.backends.debugging import aot_eager

    def marked(gm, inputs):  # aot_eager, each replay inside a profiler range of its own
        run = aot_eager(gm, inputs)

        def replay(*args):
            with torch.profiler.record_function("specbench::graph"):
                return run(*args)
        return replay

    build = compiled_module.torch_compile
    monkeypatch.setattr(compiled_module, "torch_compile", lambda fn, device, backend: build(fn, device, marked))
    drafter = make_drafter(name, compiled)
    engine = Engine(compiled, drafter, SamplingParams())
    prompts, budgets = PROMPTS[:batch], [24, 16, 28][:batch]
    engine.generate_batch(prompts, budgets)  # warm: every graph built
    counts = []
    propose = drafter.propose_rows

    def profiled(state):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tree = propose(state)
        top = [e for e in prof.events() if e.name.startswith("aten::") and not _under(e, "aten::")]
        counts.append((sum(e.name == "specbench::graph" for e in prof.events()),
                       sum(not _under(e, "specbench::graph") for e in top)))
        return tree

    monkeypatch.setattr(drafter, "propose_rows", profiled)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_batch(prompts, budgets)
    assert [g.new_tokens for g in out.rows] == [hf_greedy(compiled.model, p, n) for p, n in zip(prompts, budgets)]
    # (the first propose's forward over the prompt is a prefill, eager as the target's: one graph)
    assert counts[0][0] == 1 and len(counts) > 5 and all(replays == graphs for replays, _ in counts[1:])
    assert max(eager for _, eager in counts[1:]) <= 150


def _under(event, prefix: str) -> bool:
    """Whether a profiler event runs inside one whose name starts with prefix."""
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return True
        p = p.cpu_parent
    return False


@pytest.mark.parametrize("name", ["eagle2", "beagle", "moa_tli1", "coral_router"])
def test_a_compiled_tree_is_the_eager_tree(compiled, name):
    """The compiled region drafts what the eager levels draft: every step's tree of a ragged batch of 3, token for
    token (a region that drafted worse trees would still be lossless, only slower: the greedy tests cannot see it).
    MoA's root SA entry, drafted in the region and written again as verified in the next step, included."""
    def trees(target):
        drafter, got = make_drafter(name, target), []
        propose = drafter.propose_rows

        def recorded(state):
            tree = propose(state)
            got.append((tree.tokens.clone(), tree.parents.clone()))
            return tree

        drafter.propose_rows = recorded
        Engine(target, drafter, SamplingParams()).generate_batch(PROMPTS[:3], [16, 10, 20])
        return got

    eager, region = trees(target_for()), trees(compiled)
    assert len(eager) == len(region) > 3
    assert all(torch.equal(e[0], c[0]) and torch.equal(e[1], c[1]) for e, c in zip(eager, region))


@pytest.mark.parametrize("name", ["eagle2", "moa_tli1"])
def test_a_generation_past_a_context_block_replays_its_graphs(compiled, name):
    """Static caches and the regions' context reads come in blocks of STATIC_BLOCK positions: a generation that crosses
    one builds the next block's graphs once. Decoding the same prompt again past the block recompiles nothing (every
    shape it meets is warm), and both passes are the greedy output across the boundary. eagle2: the EAGLE family's
    tree region; moa_tli1: three regions over two caches placed at different widths (beagle passed too, by hand, at
    9996602)."""
    from specbench.decode.compiled import STATIC_BLOCK

    prompt = PROMPTS[1]
    n = STATIC_BLOCK + 24 - len(prompt)  # new tokens: the context crosses into the second block
    engine = Engine(compiled, make_drafter(name, compiled), SamplingParams())
    first = engine.generate(prompt, n).new_tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = engine.generate(prompt, n).new_tokens
    assert len(first) == n and first == second == hf_greedy(compiled.model, prompt, n)
