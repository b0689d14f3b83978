"""Cache compaction after verification (specbench/target.py): the accepted entries are moved into place behind the
root and the rest is cropped, in the storage the cache already has (the prefix is never copied)."""
import pytest
import torch
from transformers import DynamicCache

from specbench.target import compact_cache
from tests.helpers import tiny_llama


@pytest.mark.parametrize("keep", [[], [0], [0, 1, 2], [1], [0, 3, 5], [2, 4]])
def test_compact_keeps_prefix_root_and_the_accepted_entries(keep):
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
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
