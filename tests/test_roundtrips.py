"""Host round trips per decoding step, counted from outside (specbench/decode/roundtrips.py), for every drafter config: the
engine reads each verification with one transfer, and the drafters grow their trees without reading the device,
so a host read added to the hot path fails here (a GPU would stall its queue on it every step)."""
import pytest
import torch

from specbench.decode.engine import Engine
from specbench.tools.perf_drafters import count_round_trips
from specbench.decode.roundtrips import HostRoundTrips
from specbench.decode.types import SamplingParams
from tests.test_conformance import DRAFTER_CONFIGS, PROMPTS, make_drafter, target_for

@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_round_trips_per_step(name):
    """At B = 1: the engine's one read a step, and none in any drafter's propose/on_verified/lookahead (pld's draft
    lengths travel in the engine's read: Drafter.lookahead_rows)."""
    target = target_for()
    engine = Engine(target, make_drafter(name, target), SamplingParams())
    rt = count_round_trips(engine, PROMPTS[1], 40)
    assert rt["steps"] >= 5
    assert rt["per_step"] == 1 and rt["draft_per_step"] == 0, rt  # the engine: one read of the step's outcome


def test_masked_routing_drafts_without_a_host_read():
    """coral_router with `routing=masked` (the whole LM head, masked to each row's groups) grows its tree on the
    device, at B = 1 and B = 4: no drafter read, the engine's one a step (and one a step on which rows leave)."""
    target = target_for()
    engine = Engine(target, make_drafter("coral_router", target, "drafter.module.routing=masked"), SamplingParams())
    for prompts in (PROMPTS[1], [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1][:9]]):
        rt = count_round_trips(engine, prompts, 30)
        assert rt["steps"] >= 5 and rt["draft_per_step"] == 0, rt


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_round_trips_per_step_at_batch_4(name):
    """At B = 4 (ragged prompts, rows finishing at different steps): one engine read per step for all rows, plus one
    host -> device copy each time rows leave the batch (the new row order: at most B - 1 such steps), and none in
    any drafter."""
    target = target_for()
    engine = Engine(target, make_drafter(name, target), SamplingParams())
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1][:9]]
    rt = count_round_trips(engine, prompts, 30)
    steps = rt["steps"]
    assert steps >= 5 and rt["draft_per_step"] == 0, rt
    leaves = round((rt["per_step"] - rt["draft_per_step"] - 1) * steps)  # the engine's besides its one read a step
    assert 0 <= leaves <= len(prompts) - 1, rt


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


def test_a_tensor_where_aten_wants_a_number_is_counted():
    """Slice bounds, list indices and arguments ATen takes as numbers: each an .item() inside ATen (the profiler's
    _local_scalar_dense below), a sync on a GPU; ops whose Tensor overload keeps it on the device are not counted."""
    from torch.profiler import ProfilerActivity, profile

    x, i = torch.arange(6.0), torch.tensor(2)
    m = x > 2
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostRoundTrips() as rt:
        x[:i], x[1:i], x[None, ..., i]
        with pytest.warns(UserWarning, match="non-tuple sequence"):
            x[[i]]  # (a list index, read as a tuple: the 0-dim tensor in it is a scalar index)
        x.narrow(0, i, 1), torch.full((2,), i), torch.arange(i), x.view(3, i), x.topk(i), x.add(x, alpha=i)
        x.masked_fill(m, i), x.index_fill(0, i.view(1), i)  # (their Tensor overloads read it too)
        torch.where(m, x, i), x.clamp(min=i), x * i, x.clone().fill_(i)  # (on the device)
    assert rt.counts == {"scalar-index": 4, "scalar-arg": 8}
    assert _aten_scalar_reads(prof) == 12


# what the counter counts that ATen reads with _local_scalar_dense (an .item())
SCALAR_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "scalar-index", "scalar-arg"}


def _aten_scalar_reads(prof) -> int:
    """Every read of a tensor as a number ATen made (aten::_local_scalar_dense, the hidden ones included), less the
    CPU form of multinomial's validity checks (aten::_assert_async: a device-side assert on CUDA, no sync) and of
    grouped_mm's loop over its groups (CORAL's router: on CUDA it calls only the bf16 kernel, which reads its group
    offsets on the device; drafters/coral.py sync_free_groups)."""
    def under_assert(e) -> bool:
        while e is not None:
            if e.name in ("aten::_assert_async", "aten::_grouped_mm"):
                return True
            e = e.cpu_parent
        return False

    return sum(e.name == "aten::_local_scalar_dense" and not under_assert(e) for e in prof.events())


# at T>0 the engine's rejection sampling, and the drafters that sample their drafts (sd) or siblings (sd_tree)
@pytest.mark.parametrize("name,temperature", [(n, 0.0) for n in DRAFTER_CONFIGS] + [
    (n, 1.0) for n in ("none", "sd", "sd_tree", "eagle2")])
def test_no_scalar_read_hides_from_the_counter(name, temperature):
    """The profiler sees every .item() ATen makes, those inside indexing and op arguments included: in a whole
    generation (engine and drafter, greedy and sampled) each is one the counter counts, so the bounds above hold on a
    GPU too (a 0-dim index in the hot path was 2 hidden syncs per greedy step before)."""
    from torch.profiler import ProfilerActivity, profile

    target = target_for()
    engine = Engine(target, make_drafter(name, target), SamplingParams(temperature=temperature))
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostRoundTrips() as rt:
        gen = engine.generate(PROMPTS[1], 12, torch.Generator().manual_seed(0))
    assert gen.steps >= 3
    assert _aten_scalar_reads(prof) == sum(rt.counts[k] for k in SCALAR_READS), dict(rt.counts)


def test_drafters_propose_the_recorded_trees():
    """The trees grown on the device are the trees the host-side policies grew (recorded at that commit by
    scripts/record_proposals.py): every drafter config, the same tokens and parents at every recorded step."""
    import json
    from pathlib import Path

    from scripts.record_proposals import record

    recorded = json.loads((Path(__file__).parent / "data" / "proposals.json").read_text())
    # recorded when a dynamic tree kept total_tokens drafted nodes (tree.root_counted=false since the authors' count
    # became the default): the old count grows them exactly, so the recording still checks the device-grown trees
    ours = record(overrides=("++tree.root_counted=false",))
    assert set(ours) == set(recorded["proposals"])
    for name, trees in recorded["proposals"].items():
        assert len(trees) >= 5, name
        assert ours[name] == trees, name


def test_the_step_loop_waits_for_the_device_only_at_its_one_read():
    """No synchronisation inside the decode loop at B = 1 or B = 4: the phases are marked (StepClock), and the
    generation waits once at its end; so a longer decode has the same count of syncs, and its only per-step wait is
    the engine's one read (counted above)."""
    target = target_for()
    for prompts in (PROMPTS[:1], [*PROMPTS, PROMPTS[1][:9]]):
        engine = Engine(target, make_drafter("eagle2", target), SamplingParams())
        engine.generate_batch(prompts, 4)
        syncs = []
        for budget in (5, 25):
            with HostRoundTrips() as rt:
                got = engine.generate_batch(prompts, budget)
            syncs.append(rt.counts["synchronize"])
        assert got.steps >= 8 and syncs[0] == syncs[1] <= 3, syncs  # prefill (2) and the end (1)


def test_a_step_clock_on_one_gpu_marks_with_events_and_waits_once(monkeypatch):
    """On one CUDA device each mark is a timing event (no drain); resolve waits once and hands each step's phases to
    the rows that took part, and each finished row its wall time (a fake event here: its record time on the host)."""
    import time

    from specbench.decode import clock as clock_mod
    from specbench.decode.engine import Generation

    class FakeEvent:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other) -> float:
            return 1e3 * (other.t - self.t)

    monkeypatch.setattr(clock_mod.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(clock_mod.torch.cuda, "synchronize", lambda device=None: None)
    gens = [Generation(new_tokens=[], prompt_tokens=3, wall_s=0.0, prefill_s=0.5) for _ in range(2)]
    with HostRoundTrips() as rt:
        clock = clock_mod.StepClock((torch.device("cuda"),), offset=0.5)
        assert clock.events and not clock.drain
        for step in range(3):
            a = clock.mark()
            time.sleep(0.002)
            b = clock.mark()
            time.sleep(0.001)
            clock.step(a, b, clock.mark(), gens if step < 2 else gens[:1])
            if step == 1:
                clock.finish(gens[1], clock.mark())
        clock.finish(gens[0], clock.mark())
        assert rt.counts["synchronize"] == 0
        clock.resolve()
    assert rt.counts["synchronize"] == 1
    assert gens[0].draft_s >= 3 * 0.002 and gens[1].draft_s >= 2 * 0.002 and gens[1].draft_s < gens[0].draft_s
    assert gens[0].verify_s >= 3 * 0.001 and gens[0].wall_s > gens[1].wall_s > 0.5
