"""CORAL: the cross-step InfoNCE loss and the LM-head router (Eq. 7-9) on small exact cases."""
import math

import pytest
import torch
import torch.nn.functional as F

from drafters.coral import CoralDrafter, CoralRouterDrafter, LMHeadRouter, csra_loss
from specbench.checkpoints import save_checkpoint, target_fingerprint
from specbench.target import TargetModel
from tests.helpers import tiny_llama


def test_csra_matches_a_direct_sum():
    torch.manual_seed(0)
    preds, true, tau = [torch.randn(3, 4), torch.randn(3, 4)], torch.randn(3, 4), 0.5
    views = [F.normalize(v, dim=-1) for v in (*preds, true)]  # view v, position i
    total, count = 0.0, 0
    for a in range(2):  # anchors: step outputs only
        for i in range(3):
            z = views[a][i]
            num = sum(math.exp(float(z @ views[b][i]) / tau) for b in range(3) if b != a)
            den = sum(math.exp(float(z @ views[b][k]) / tau) for b in range(3) for k in range(3) if (b, k) != (a, i))
            total += -math.log(num / den)
            count += 1
    assert csra_loss(preds, true, tau).item() == pytest.approx(total / count, rel=1e-5)


def test_csra_is_low_when_views_agree_and_positions_differ():
    torch.manual_seed(0)
    base = torch.randn(16, 32)
    aligned = csra_loss([base + 0.01 * torch.randn(16, 32) for _ in range(3)], base, 0.07)
    shuffled = csra_loss([torch.randn(16, 32) for _ in range(3)], base, 0.07)
    assert aligned < 0.1 < shuffled


def test_router_distribution_is_eq8_on_active_groups():
    torch.manual_seed(0)
    router = LMHeadRouter(hidden=8, vocab=10, groups=3, active=2)  # groups of 4, 4, 2 tokens
    weight, f = torch.randn(10, 8), torch.randn(5, 8)
    logq = router.log_probs(weight, f)
    r = router(f).softmax(-1)
    logits = f @ weight.T
    for row in range(5):
        top = set(r[row].topk(2).indices.tolist())
        for g in range(3):
            lo, hi = 4 * g, min(4 * g + 4, 10)
            if g in top:
                want = r[row, g] * logits[row, lo:hi].softmax(-1)
                torch.testing.assert_close(logq[row, lo:hi].exp(), want, atol=1e-6, rtol=1e-5)
            else:
                assert torch.isinf(logq[row, lo:hi]).all()
    # with every group active q is a distribution
    full = LMHeadRouter(hidden=8, vocab=10, groups=3, active=3)
    full.proj.weight.data = router.proj.weight.data
    torch.testing.assert_close(full.log_probs(weight, f).exp().sum(-1), torch.ones(5))


def test_group_mass_sums_probability_per_group():
    router = LMHeadRouter(hidden=2, vocab=5, groups=2, active=1)  # groups {0,1,2}, {3,4}
    p = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.25]])
    torch.testing.assert_close(router.group_mass(p), torch.tensor([[0.6, 0.4]]))


def test_router_stage_trains_only_the_router_on_the_frozen_head(tmp_path):
    from specbench.train import Batch

    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    head = CoralDrafter.build_module(target, steps=2)
    save_checkpoint(tmp_path / "coral", head, target, {"drafter": "coral", "module": {"steps": 2},
                                                     "target_fingerprint": target_fingerprint(target)})
    routed = CoralRouterDrafter.build_module(target, base=str(tmp_path / "coral"), groups=4, active=2)
    assert routed.steps == 2  # stage-1 options come from the base checkpoint
    trainable = {n for n, p in routed.named_parameters() if p.requires_grad}
    assert trainable == {"router.proj.weight"}
    torch.testing.assert_close(routed.fc.weight, head.fc.weight)
    ids = torch.randint(0, 64, (2, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 10, dtype=torch.long)
    batch = Batch(ids, ones, ones, hidden, hidden)
    loss, parts = CoralRouterDrafter.training_loss(routed, batch, target)
    loss.backward()
    assert routed.router.proj.weight.grad is not None and set(parts) >= {"router1", "router2", "hit1"}
