"""MoA: T-step-bounded blocks, and training-time prediction == the decoding path (LSA, SA, CA, TLI caches)."""
import pytest
import torch

from drafters.moa import MoADrafter, bounded_starts
from specbench.target import TargetModel, cache_kv
from specbench.types import TargetState
from tests.helpers import tiny_llama


def test_blocks_are_between_the_bounds_and_see_only_earlier_activations():
    starts = bounded_starts(200, 5, 15, torch.Generator().manual_seed(0), "cpu")
    assert starts[0] == -1
    firsts = sorted(set((starts[1:] + 1).tolist()))
    sizes = [b - a for a, b in zip(firsts, firsts[1:])]
    assert all(5 <= s <= 15 for s in sizes)
    assert all(starts[q] < q for q in range(200))


@pytest.mark.parametrize("tli", [0, 1, 2])
def test_training_prediction_equals_drafting(tli):
    target = TargetModel(tiny_llama(vocab=64, layers=3, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    net = MoADrafter.build_module(target, MoADrafter.options(tli=tli, lsa_head_dim=16, lsa_mlp=48, sa_mlp=16,
                                                            ca_mlp=48)).eval()
    t = 16
    ids = torch.randint(0, 64, (1, t))
    cache = target.new_cache()
    target.forward(ids, cache, logits_rows=slice(0, 0))
    kv = torch.stack([torch.cat([k[0].transpose(0, 1).flatten(1), v[0].transpose(0, 1).flatten(1)], -1)
                      for k, v in cache_kv(cache)], 1)[None]  # [1, T, L, 2E_kv]
    starts = bounded_starts(t, 5, 15, torch.Generator().manual_seed(3), "cpu")
    with torch.no_grad():
        _, logits = MoADrafter.predict(net, target, ids, kv, torch.ones(1, t, dtype=torch.long), starts)
    d = MoADrafter(target, net=net)
    with torch.no_grad():
        for n in sorted(set(starts.tolist()) - {-1}):  # every block: activations up to n, queries n+1 ..
            d.prefill(None)
            prefix = target.new_cache()
            target.forward(ids[:, : n + 1], prefix, logits_rows=slice(0, 0))
            state = TargetState(tokens=ids[:, : n + 2], hidden=None, kv=cache_kv(prefix))
            for q in [i for i in range(t) if starts[i] == n]:
                got = d._root_logits(ids[:, : q + 1], state)
                torch.testing.assert_close(got, logits[0, q], atol=1e-4, rtol=1e-4)
