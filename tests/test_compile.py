"""model.compile (issue 30): the target's tree forwards, and the drafters' decoders (EAGLE's head, sd's draft model),
through torch.compile over static caches, trees padded to buckets. Every drafter config decodes its greedy output through it (with dynamo's aot_eager backend: the same graph
capture, static shapes and guards as inductor, without its C++ build; one inductor case), nothing recompiles once the
buckets are warm, and the static cache refuses what it cannot hold."""
import pytest
import torch

from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.decode.kvcache import StaticCache
from specbench.bench.run import Runner
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams, TargetState
from tests.helpers import hf_greedy, tiny_llama
from tests.test_conformance import DRAFTER_CONFIGS, PROMPTS, make_drafter


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
    """A chain of sd's gamma tokens fills one bucket, the baseline another: after one generation each, other prompts
    (the same cache block) decode without a recompile, and their steps ran through the compiled graphs (not the eager
    fallback, where error_on_recompile would have nothing to catch)."""
    calls = []
    step = compiled.compiled.step
    monkeypatch.setattr(compiled.compiled, "step", lambda *a: calls.append(1) or step(*a))
    engines = [Engine(compiled, make_drafter(n, compiled), SamplingParams()) for n in ("none", "sd")]
    for engine in engines:
        engine.generate(PROMPTS[0], 30)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for engine in engines:
            for prompt in PROMPTS[1:]:
                calls.clear()
                assert engine.generate(prompt, 30).new_tokens == hf_greedy(compiled.model, prompt, 30)
                assert len(calls) > 1  # every step after the (eager) prefill


@pytest.mark.parametrize("name", ["eagle2", "sd_tree"])
def test_the_drafters_decoders_run_compiled_on_their_own_static_caches(compiled, name):
    """EAGLE's head (eagle, eagle2, hass, coral) and sd's draft model run through their own compiled decoder, on a
    static cache of their own: its graphs are warm after one pass, so a second pass over the same prompts (tokens
    sliced from a longer sequence: strides that differ) recompiles nothing and decodes the same tokens."""
    engine = Engine(compiled, make_drafter(name, compiled), SamplingParams())
    first = [engine.generate(p, 30).new_tokens for p in PROMPTS[:2]]
    cache = engine.drafter.cache
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
    with pytest.raises(SpecbenchError, match="one row at a time"):
        cache.layers[0].set_row_lengths([3, 4])


def test_compile_with_batches_is_refused_in_one_line(make_cfg, compiled):
    with pytest.raises(SpecbenchError, match="model.compile=true decodes one prompt at a time"):
        Runner(make_cfg("drafter=none", "model.compile=true", "decoding.batch_size=2"))
    with pytest.raises(SpecbenchError, match="model.compile=true decodes one prompt at a time"):
        Engine(compiled, make_drafter("eagle2", compiled), SamplingParams()).generate_batch(PROMPTS[:2], 8)


def test_a_drafters_static_cache_holds_what_the_targets_holds(compiled):
    """A static cache cannot grow: a drafter's (asked for its prompt + 1024 positions) is at least as large as the
    target's, which is sized to the generation (here 1500 new tokens: past the drafter's own ask)."""
    engine = Engine(compiled, make_drafter("sd", compiled), SamplingParams())
    engine.generate(PROMPTS[0], 2)
    small = engine.drafter.cache.capacity
    compiled.new_cache(len(PROMPTS[0]) + 1500)
    engine.drafter.prefill(TargetState(tokens=torch.tensor([PROMPTS[0]]), hidden=None, kv=None))
    assert engine.drafter.cache.capacity >= compiled.compiled.capacity > small
