"""Cache compaction after verification (specbench/decode/target.py): the accepted entries are moved into place behind the
root and the rest is cropped, in the storage the cache already has (the prefix is never copied). The preallocated
cache (specbench/decode/kvcache.py), which every decode runs on, attends as DynamicCache does, writes in place and
grows only past its capacity; every drafter's own cache is one of the same kind, sized to the generation."""
import pytest
import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin

from specbench.decode.draftcache import DraftCache
from specbench.decode.engine import Engine
from specbench.errors import SpecbenchError
from specbench.decode.kvcache import PreallocatedCache, PreallocatedLayer
from specbench.decode.target import TargetModel, compact_cache
from specbench.decode.types import SamplingParams
from tests.helpers import hf_greedy, tiny_llama

CACHES = {"dynamic": lambda cfg: DynamicCache(config=cfg), "preallocated": lambda cfg: PreallocatedCache(cfg, 64)}


@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("keep", [[], [0], [0, 1, 2], [1], [0, 3, 5], [2, 4]])
def test_compact_keeps_prefix_root_and_the_accepted_entries(keep, kind):
    model = tiny_llama()
    cache = CACHES[kind](model.config)
    prefix, nodes = 9, 6
    torch.manual_seed(0)
    model(input_ids=torch.randint(0, 100, (1, prefix + 1 + nodes)), past_key_values=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone(), layer.keys.data_ptr()) for layer in cache.layers]
    compact_cache(cache, prefix, torch.tensor(keep, dtype=torch.long), contiguous=keep == list(range(len(keep))))
    idx = list(range(prefix + 1)) + [prefix + 1 + i for i in keep]  # what the old gather kept
    assert cache.get_seq_length() == len(idx)
    for layer, (k, v, ptr) in zip(cache.layers, before):
        assert torch.equal(layer.keys, k[..., idx, :]) and torch.equal(layer.values, v[..., idx, :])
        assert layer.keys.data_ptr() == ptr  # moved in place and cropped: the prefix was not rebuilt


def test_a_preallocated_cache_attends_as_a_dynamic_one_and_grows_only_past_its_capacity():
    model = tiny_llama()
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 12))
    small, ref = PreallocatedCache(model.config, 8), DynamicCache(config=model.config)
    out, out0 = [], []
    for chunk in (ids[:, :5], ids[:, 5:7], ids[:, 7:12]):  # the third forward runs past 8 positions
        out.append(model(input_ids=chunk, past_key_values=small, use_cache=True).logits)
        out0.append(model(input_ids=chunk, past_key_values=ref, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(out, 1), torch.cat(out0, 1), atol=0, rtol=0)
    layer = small.layers[0]
    assert small.get_seq_length() == 12 and layer.capacity == 24  # grown once, to twice the need
    ptr = layer.keys.data_ptr()
    small.crop(-3)
    model(input_ids=ids[:, 9:11], past_key_values=small, use_cache=True)
    assert small.get_seq_length() == 11 and layer.keys.data_ptr() == ptr  # a crop and a write: no reallocation
    with pytest.raises(AttributeError, match="written in place"):
        layer.keys = torch.zeros(1)


@pytest.mark.parametrize("name", ["pld", "sd", "sd_tree", "medusa", "eagle", "eagle2", "eagle3", "hass", "coral",
                                  "coral_router", "beagle", "moa", "moa_tli1"])
def test_every_drafter_keeps_its_own_cache_preallocated_and_sized_to_the_generation(name):
    """A drafter that keeps its own keys and values keeps them in the target's kind of cache at every B (issue 77:
    the rows of a batch, written in place), sized as the target's for the generation (prompt + budget + a tree) and
    never grown; the engine's output the target's greedy output."""
    from tests.test_conformance import PROMPTS, make_drafter

    model = tiny_llama(scale=20.0)
    target = TargetModel(model, None, torch.device("cpu"), "tiny")
    drafter = make_drafter(name, target)
    for prompt in PROMPTS:
        assert Engine(target, drafter, SamplingParams()).generate(prompt, 40).new_tokens == hf_greedy(model, prompt, 40)
    layers = own_cache_layers(drafter)
    assert (name in ("pld", "medusa")) == (not layers)
    assert all(isinstance(x, PreallocatedLayer) for x in layers)
    assert {x.capacity for x in layers} <= {len(PROMPTS[-1]) + 40 + 256}


def own_cache_layers(drafter) -> list:
    """The cache layers a drafter holds in its attributes (a Cache's layers, lone layers, lists of them)."""
    found = []
    for value in vars(drafter).values():
        for x in value if isinstance(value, list) else [value]:
            x = getattr(x, "cache", x) if isinstance(x, DraftCache) else x  # (the cache a DraftCache keeps)
            found += x.layers if isinstance(x, Cache) else [x] if isinstance(x, CacheLayerMixin) else []
    return found


def test_a_target_whose_layers_it_cannot_hold_is_refused_in_one_line():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=16)
    target = TargetModel(MistralForCausalLM(cfg), None, torch.device("cpu"), "m")
    with pytest.raises(SpecbenchError, match="full-attention layers only; mistral has "):
        target.new_cache(64, ragged=True)  # the cache every decode runs on, before the first forward


def test_make_limit_reports_the_baseline_against_the_bare_matmul_time(tiny_checkpoint, question_file, tmp_path):
    """specbench/tools/limit.py on the tiny target: a bare-matmul time over its 6 x 7 + 1 weight matrices, and the
    baseline's ms per token with its overhead share, eager (on the preallocated cache every decode runs on) and
    compiled (measured, so only their signs and shapes are checked)."""
    from hydra import compose, initialize_config_dir

    from specbench.core.config import register_schema
    from specbench.tools.limit import run_limit
    from tests.test_conformance import CONF

    register_schema()
    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        cfg = compose(config_name="limit", overrides=[f"model.path={tiny_checkpoint}", "model.name=tiny", "dataset=jsonl",
                                                      f"dataset.path={question_file}", "decoding.max_new_tokens=4",
                                                      "bench.repeats=1", "bench.warmup=0",
                                                      f"out.root={tmp_path}"])
    r = run_limit(cfg)
    assert r["weight_matrices"] == 6 * 7 + 1 and r["bare_ms_per_token"] > 0
    assert set(r["eager"]) == {"preallocated"}
    # each path slower than the bare matmuls of its weights (a share of 0 or less: a wrong denominator or bare loop)
    assert all(0 < row["overhead_share"] < 1 for row in [*r["eager"].values(), r["compiled"]])  # + model.compile's row
    assert all(row["baseline_ms_per_token"] > r["bare_ms_per_token"] for row in [*r["eager"].values(), r["compiled"]])


def test_ragged_rows_write_behind_their_own_entries():
    """Batched decoding's ragged rows (issue 29): after set_row_lengths, each row's new entries land behind its own
    length, the views reach the longest row, a crop shortens every row, and equal lengths end raggedness."""
    model = tiny_llama()
    cache = PreallocatedCache(model.config, 16)
    torch.manual_seed(0)
    model(input_ids=torch.randint(0, 100, (2, 6)), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    before = layer.keys.clone()  # [2, kv_heads, 6, dh]
    cache.set_row_lengths([6, 4])  # row 1 kept 4 of its entries
    new_k = torch.randn(2, before.shape[1], 3, before.shape[-1])
    k, _ = layer.update(new_k, new_k.clone())
    assert k.shape[2] == 9 and layer.rows.host == (9, 7) and layer.rows.dev.tolist() == [9, 7] and cache.get_seq_length() == 9
    assert torch.equal(k[0, :, :6], before[0]) and torch.equal(k[0, :, 6:9], new_k[0])
    assert torch.equal(k[1, :, :4], before[1, :, :4]) and torch.equal(k[1, :, 4:7], new_k[1])
    cache.crop(-2)
    assert layer.rows.host == (7, 5) and layer.rows.dev.tolist() == [7, 5] and layer.length == 7
    cache.set_row_lengths([5, 5])
    assert layer.rows is None and layer.length == 5
