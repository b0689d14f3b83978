"""Host round trips per decoding step, counted from outside (specbench/roundtrips.py), for every drafter config: the
engine reads each verification with one transfer, and the drafters grow their trees without reading the device,
so a host read added to the hot path fails here (a GPU would stall its queue on it every step)."""
import pytest
import torch

from specbench.engine import Engine
from specbench.perf_drafters import count_round_trips
from specbench.roundtrips import HostRoundTrips
from specbench.types import SamplingParams
from tests.test_conformance import DRAFTER_CONFIGS, PROMPTS, make_drafter, target_for

# host round trips per step inside the drafter's propose/on_verified, at most
DRAFT_BOUND = {
    "pld": 2 * 2,  # per n-gram size tried (max_ngram 2 .. min_ngram 1): the match search and its position
    "coral_router": 2 * 6,  # per draft depth (6): which rows chose which vocabulary group, and their indices back
}


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_round_trips_per_step(name):
    target = target_for()
    engine = Engine(target, make_drafter(name, target), SamplingParams())
    rt = count_round_trips(engine, PROMPTS[1], 40)
    assert rt["steps"] >= 5
    assert rt["per_step"] - rt["draft_per_step"] == 1, rt  # the engine: one read of the tree and its outcome
    assert rt["draft_per_step"] <= DRAFT_BOUND.get(name, 0), rt


def test_sampling_steps_read_once():
    """At T>0 too (rejection sampling over a tree, deterministic or sampled siblings, the recovered token drawn on
    the device): the engine reads once per step."""
    from tests.helpers import RandomTreeDrafter

    target = target_for()
    for sampling in (False, True):
        engine = Engine(target, RandomTreeDrafter(128, seed=3, sampling=sampling), SamplingParams(temperature=1.0))
        rt = count_round_trips(engine, PROMPTS[0], 30)
        assert rt["steps"] >= 5 and rt["per_step"] - rt["draft_per_step"] == 1, rt


def test_the_counter_sees_what_stalls_a_gpu():
    x = torch.arange(6.0)
    with HostRoundTrips() as rt:
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        x.nonzero()
        x[x > 2]
        torch.tensor([1, 2])
        x.to("cpu")
        torch.arange(3)  # built on the device: not counted
        x.to(x.device)  # the same device: not counted
        torch.tensor([])  # nothing to copy
        i = torch.tensor(2)  # (a copy itself)
        x[i]  # a 0-dim index: ATen's .item() on it, which no .item() count sees
        x[(i,)]
        x[i] = 0.0
        x.index_select(0, i.view(1))  # on the device: not counted
    assert rt.counts == {"item": 1, "tolist": 1, "__bool__": 1, "nonzero": 1, "bool-index": 1, "tensor": 2,
                         "to(cpu)": 1, "scalar-index": 3}


def test_drafters_propose_the_recorded_trees():
    """The trees grown on the device are the trees the host-side policies grew (recorded at that commit by
    scripts/record_proposals.py): every drafter config, the same tokens and parents at every recorded step."""
    import json
    from pathlib import Path

    from scripts.record_proposals import record

    recorded = json.loads((Path(__file__).parent / "data" / "proposals.json").read_text())
    ours = record()
    assert set(ours) == set(recorded["proposals"])
    for name, trees in recorded["proposals"].items():
        assert len(trees) >= 5, name
        assert ours[name] == trees, name
