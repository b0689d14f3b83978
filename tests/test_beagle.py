"""Beagle: block-attention windows, and the late-stage simulation equals drafting with predicted states ("concate")."""
from dataclasses import replace

import torch

from drafters.beagle import BeagleDrafter, simulated_steps, window_starts
from specbench.decode.target import TargetModel
from specbench.train.trainer import Batch
from tests.helpers import tiny_llama


def test_windows_tile_the_sequence_from_a_random_offset():
    start = window_starts(13, 5, 2, "cpu")
    assert start.tolist() == [-3, -3, -3, 2, 2, 2, 2, 2, 7, 7, 7, 7, 7]
    rel = torch.arange(13) - start
    assert rel.min() == 1 and rel.max() == 5


OPTS = BeagleDrafter.options(window=4, sim_steps=3)


def setup(seed=0, t=14):
    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(seed)
    block = BeagleDrafter.build_module(target, OPTS).eval()
    ids = torch.randint(0, 64, (1, t))
    hidden = target.prefill(ids, target.new_cache()).hidden
    return target, block, ids, hidden


def test_simulated_steps_equal_drafting_with_own_states():
    target, block, ids, hidden = setup()
    t = ids.shape[1]
    start = window_starts(t, 4, 1, "cpu")
    emb = target.decoder.embed_tokens(ids)
    with torch.no_grad():
        outs = list(simulated_steps(block, emb, hidden, torch.ones(1, t, dtype=torch.bool), start, 3))
        for q in range(t):
            n, r = int(start[q]), int(q - start[q])
            if n < 0 or r > 3:
                continue
            states, pos = hidden[:, : n + 1], torch.arange(n + 1)[None]
            for d in range(1, r + 1):  # the window's queries n+1 .. n+r in turn, each appending its state
                allowed = torch.ones(1, 1, 1, states.shape[1], dtype=torch.bool)
                h = block(emb[:, n + d : n + d + 1], torch.tensor([[n + d]]), allowed, kv=block.keys(states, pos))
                states, pos = torch.cat([states, h], 1), torch.cat([pos, torch.tensor([[n + d]])], 1)
            torch.testing.assert_close(outs[r - 1][:, q], h[:, 0], atol=1e-5, rtol=1e-4)


def test_early_stage_is_one_graph_and_late_stage_one_per_simulated_step():
    target, block, ids, hidden = setup(t=20)
    block.train()
    ones = torch.ones_like(ids)
    batch = Batch(ids, ones, ones, hidden, hidden)
    early = list(BeagleDrafter.training_steps(block, batch, target, OPTS, epoch=0))
    late = list(BeagleDrafter.training_steps(block, batch, target, OPTS, epoch=1))
    assert len(early) == 1 and early[0][1]["stage"] == 0
    assert len(late) == 3 and all(p["stage"] == 1 for _, p in late)
    for loss, _ in late:  # independent graphs: each backpropagates alone
        loss.backward()
    assert block.q_proj.weight.grad is not None


def test_vloss_keeps_its_coefficient_whatever_the_ce_weight():
    """App. A.3: vloss x 10 in both stages; Eq. 4's sum over k lookaheads and Eq. 6's beta*_i weigh the CE only."""
    target, block, ids, hidden = setup(t=20)
    ones = torch.ones_like(ids)
    batch = Batch(ids, ones, ones, hidden, hidden)
    torch.manual_seed(3)
    (early, parts), = BeagleDrafter.training_steps(block, batch, target, OPTS, epoch=0)
    torch.manual_seed(3)
    (no_v, _), = BeagleDrafter.training_steps(block, batch, target, replace(OPTS, vloss_weight=0.0), epoch=0)
    torch.testing.assert_close(early - no_v, torch.tensor(OPTS.vloss_weight * parts["vloss"]), rtol=1e-4, atol=1e-5)
    torch.manual_seed(3)
    late = list(BeagleDrafter.training_steps(block, batch, target, OPTS, epoch=1))
    torch.manual_seed(3)
    late0 = list(BeagleDrafter.training_steps(block, batch, target, replace(OPTS, vloss_weight=0.0), epoch=1))
    for i, ((a, p), (b, _)) in enumerate(zip(late, late0), 1):
        torch.testing.assert_close(a - b, torch.tensor(OPTS.vloss_weight * p[f"vloss{i}"]), rtol=1e-4, atol=1e-5)
    torch.manual_seed(3)
    (scaled, _), = BeagleDrafter.training_steps(block, batch, target, replace(OPTS, vloss_scaled=True), epoch=0)
    torch.testing.assert_close(scaled - no_v, torch.tensor(OPTS.window * OPTS.vloss_weight * parts["vloss"]),
                               rtol=1e-4, atol=1e-5)
