"""CORAL: the cross-step InfoNCE loss and the LM-head router (Eq. 7-9) on small exact cases."""
import math

import pytest
import torch
import torch.nn.functional as F

from drafters.coral import CoralDrafter, CoralRouterDrafter, LMHeadRouter, csra_loss
from specbench.decode.checkpoints import save_checkpoint, target_identity
from specbench.decode.target import TargetModel
from tests.helpers import tiny_llama


def csra_reference(steps: list[torch.Tensor], true: torch.Tensor, j: int, tau: float) -> float:
    """Eq. 2 at step j, written out term by term: anchors F^j_i; Z = F^1..F^j and the targets; positives = the other
    views of position i that exist at step j."""
    views = [F.normalize(v, dim=-1) for v in (*steps[:j], true)]  # views 0..j-1 = steps 1..j, view j = targets
    a, m = j - 1, true.shape[0]
    total = 0.0
    for i in range(m):
        z = views[a][i]
        num = sum(math.exp(float(z @ views[b][i]) / tau) for b in range(j + 1) if b != a)
        den = sum(math.exp(float(z @ views[b][k]) / tau) for b in range(j + 1) for k in range(m) if (b, k) != (a, i))
        total += -math.log(num / den)
    return total / m


@pytest.mark.parametrize("j", [1, 2, 3])
def test_csra_at_step_j_matches_a_direct_per_step_reference(j):
    torch.manual_seed(0)
    steps, true, tau = [torch.randn(4, 6) for _ in range(3)], torch.randn(4, 6), 0.5
    got = csra_loss(steps[j - 1], [*steps[: j - 1], true], tau).item()
    assert got == pytest.approx(csra_reference(steps, true, j, tau), rel=1e-5)
    # a later step's outputs do not exist yet at step j: changing them changes nothing
    steps[2] = torch.randn(4, 6)
    if j < 3:
        assert csra_loss(steps[j - 1], [*steps[: j - 1], true], tau).item() == pytest.approx(got, rel=1e-6)


def test_csra_is_low_when_views_agree_and_positions_differ():
    torch.manual_seed(0)
    base = torch.randn(16, 32)
    aligned = csra_loss(base + 0.01 * torch.randn(16, 32), [base + 0.01 * torch.randn(16, 32), base], 0.07)
    shuffled = csra_loss(torch.randn(16, 32), [torch.randn(16, 32), base], 0.07)
    assert aligned < 0.1 < shuffled


def test_coral_training_is_eq3_per_step_without_a_topk_term():
    """Each step: 0.5 L_reg + 0.1 L_cls + w_csra L_CSRA^j on its own graph; CSRA's views from earlier steps are
    detached, so step j's CSRA gradient reaches step j's anchors only."""
    from drafters.distill import soft_ce, teacher_probs
    from drafters.hass import harmonized_steps
    from specbench.train.trainer import Batch

    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    opts = CoralDrafter.options(steps=3, csra_weight=0.3)
    head = CoralDrafter.build_module(target, opts)
    ids = torch.randint(0, 64, (2, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 10, dtype=torch.long)
    batch = Batch(ids, ones, ones, hidden, hidden)
    pieces = list(CoralDrafter.training_steps(head, batch, target, opts, epoch=5))
    assert len(pieces) == 3 and all(not any(k.startswith("top") for k in parts) for _, parts in pieces)
    with torch.no_grad():  # the same numbers written out
        emb = target.decoder.embed_tokens(ids[:, 1:])
        preds = [p[:, :-1].reshape(-1, 32) for p in harmonized_steps(head, emb, hidden[:, :-1], ones[:, 1:], 3)]
        true = hidden[:, 1:-1].reshape(-1, 32)
        p = teacher_probs(target, true)
        for j in (1, 2, 3):
            reg = F.smooth_l1_loss(preds[j - 1], true, reduction="none").mean(-1).mean()
            cls_ = soft_ce(p, target.lm_head(preds[j - 1]).log_softmax(-1))
            want = 0.5 * reg + 0.1 * cls_ + 0.3 * csra_reference(preds, true, j, 0.07)
            assert pieces[j - 1][0].item() == pytest.approx(want.item(), rel=1e-4)


def test_coral_csra_views_graph_backpropagates_the_summed_steps_through_every_view():
    """`csra_views: graph`: one piece, the sum of the detached form's step losses, whose gradient also reaches the
    earlier steps' views (so it differs from the step-by-step gradient, and equals a direct sum's)."""
    from drafters.hass import harmonized_steps
    from specbench.train.trainer import Batch

    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 10, dtype=torch.long)
    batch = Batch(ids, ones, ones, hidden, hidden)

    def grads(views: str) -> tuple[float, int, list[torch.Tensor]]:  # summed loss, pieces, the gradients
        torch.manual_seed(0)
        opts = CoralDrafter.options(steps=3, csra_weight=0.3, csra_views=views)
        head = CoralDrafter.build_module(target, opts)
        total, count = 0.0, 0
        for piece, _ in CoralDrafter.training_steps(head, batch, target, opts, epoch=0):
            piece.backward()  # as the trainer does, piece by piece
            total, count = total + piece.item(), count + 1
        return total, count, [w.grad.clone() for w in head.parameters() if w.grad is not None]

    loss_d, n_d, g_d = grads("detached")
    loss_g, n_g, g_g = grads("graph")
    assert (n_d, n_g) == (3, 1)
    assert loss_g == pytest.approx(loss_d, rel=1e-5)
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(g_d, g_g, strict=True))
    # the graph form's gradient is that of the summed L^j with nothing detached in CSRA
    torch.manual_seed(0)
    opts = CoralDrafter.options(steps=3, csra_weight=0.3)
    head = CoralDrafter.build_module(target, opts)
    emb, mask_tok, true, p = CoralDrafter.step_targets(batch, target, opts.loss_mask)
    preds = [s[mask_tok] for s in harmonized_steps(head, emb, hidden[:, :-1], ones[:, 1:], 3)]
    want = sum(CoralDrafter.step_loss(pr, true, p, target, topk=0, topk_weight=0.0)[0]
               + 0.3 * csra_loss(pr, [*preds[:j], true], 0.07) for j, pr in enumerate(preds))
    want.backward()
    for a, b in zip(g_g, [w.grad for w in head.parameters() if w.grad is not None], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="csra_views"):
        CoralDrafter.options(csra_views="all")


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


@pytest.mark.parametrize("vocab,groups,active", [(10, 3, 2), (12, 4, 1), (7, 7, 3)])
def test_masked_routing_is_the_grouped_distribution(vocab, groups, active):
    """`routing=masked` (the whole LM head, then the rows' active groups) gives the q of `grouped` (the active
    groups' rows only): the same -inf pattern and the same log-probabilities, a last group shorter or not."""
    torch.manual_seed(vocab)
    grouped = LMHeadRouter(hidden=8, vocab=vocab, groups=groups, active=active)
    masked = LMHeadRouter(hidden=8, vocab=vocab, groups=groups, active=active, routing="masked")
    masked.proj.weight.data = grouped.proj.weight.data
    weight, f = torch.randn(vocab, 8), torch.randn(2, 3, 8)
    want, got = grouped.log_probs(weight, f), masked.log_probs(weight, f)
    assert got.shape == want.shape == (2, 3, vocab)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-6, rtol=1e-5)


def host_grouped(router: LMHeadRouter, weight: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """`grouped` as it was routed before the device did it (up to 12 host reads a step): each row's groups read on
    the host, then every chosen group's head rows times the rows that chose it, rows ascending. f [R, H] -> [R, V]."""
    log_r = router(f).float().log_softmax(-1)
    out = torch.full((f.shape[0], router.vocab), float("-inf"))
    chosen: dict[int, list[int]] = {}
    for r, groups in enumerate(log_r.topk(router.active, dim=-1).indices.tolist()):
        for g in groups:
            chosen.setdefault(g, []).append(r)
    for g, rows in sorted(chosen.items()):
        lo, hi = g * router.group_size, min((g + 1) * router.group_size, router.vocab)
        out[rows, lo:hi] = F.linear(f[rows], weight[lo:hi]).float().log_softmax(-1) + log_r[rows, g : g + 1]
    return out


@pytest.mark.parametrize("vocab,groups,active,rows", [(128, 16, 2, 10), (10, 3, 2, 7), (12, 4, 1, 5), (7, 7, 3, 4),
                                                      (640, 16, 2, 40), (100, 16, 2, 10)])
def test_grouped_routing_on_the_device_is_the_host_routing_bit_for_bit(vocab, groups, active, rows):
    """`grouped` sorts the (row, group) pairs by group and multiplies them in one grouped matmul, its group sizes on
    the device: no host read, and the very numbers of the host-read routing (the same rows against the same head rows
    per group) where N divides the vocabulary (the models here: 128, 49152, 128256, 152064 by 16). With no sync-free
    grouped matmul on its device (grouped_mm off) it takes the whole head: `masked`'s q."""
    from specbench.decode.roundtrips import HostRoundTrips

    torch.manual_seed(vocab + rows)
    router = LMHeadRouter(hidden=16, vocab=vocab, groups=groups, active=active)
    weight, f = torch.randn(vocab, 16), torch.randn(rows, 16)
    with HostRoundTrips() as rt:
        got = router.log_probs(weight, f)
    assert not rt.counts, dict(rt.counts)
    want = host_grouped(router, weight, f)
    if vocab % groups == 0:
        assert torch.equal(got, want)
    else:  # the short group padded to G: its softmax and products over a longer row, last-bit differences there
        full = vocab // router.group_size * router.group_size  # the groups of G tokens: bit for bit
        assert torch.equal(got[:, :full], want[:, :full]) and torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    router.grouped_mm = False
    masked = LMHeadRouter(hidden=16, vocab=vocab, groups=groups, active=active, routing="masked")
    masked.proj.weight.data = router.proj.weight.data
    assert torch.equal(router.log_probs(weight, f), masked.log_probs(weight, f))


def test_a_hidden_size_grouped_mm_cannot_take_routes_through_the_whole_head():
    """F.grouped_mm wants its rows on 16 bytes: a hidden size of 6 fp32 takes the whole head (`masked`'s q)."""
    router = LMHeadRouter(hidden=6, vocab=12, groups=4, active=2)
    assert not router.grouped_mm
    masked = LMHeadRouter(hidden=6, vocab=12, groups=4, active=2, routing="masked")
    masked.proj.weight.data = router.proj.weight.data
    weight, f = torch.randn(12, 6), torch.randn(5, 6)
    assert torch.equal(router.log_probs(weight, f), masked.log_probs(weight, f))


def test_an_unknown_routing_is_refused_in_one_line():
    with pytest.raises(ValueError, match="drafter.module.routing='dense': one of grouped, masked"):
        LMHeadRouter(hidden=8, vocab=10, groups=3, active=2, routing="dense")


def test_group_mass_sums_probability_per_group():
    router = LMHeadRouter(hidden=2, vocab=5, groups=2, active=1)  # groups {0,1,2}, {3,4}
    p = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.25]])
    torch.testing.assert_close(router.group_mass(p), torch.tensor([[0.6, 0.4]]))


def test_router_stage_trains_only_the_router_on_the_frozen_head(tmp_path):
    from specbench.train.trainer import Batch

    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    head = CoralDrafter.build_module(target, CoralDrafter.options(steps=2))
    save_checkpoint(tmp_path / "coral", head, target, {"drafter": "coral", "module": {"steps": 2},
                                                     **target_identity(target)})
    opts = CoralRouterDrafter.options(base=str(tmp_path / "coral"), groups=4, active=2)
    routed = CoralRouterDrafter.build_module(target, opts)
    assert CoralRouterDrafter.head_options(opts).steps == 2  # stage-1 options come from the base checkpoint
    trainable = {n for n, p in routed.named_parameters() if p.requires_grad}
    assert trainable == {"router.proj.weight"}
    torch.testing.assert_close(routed.fc.weight, head.fc.weight)
    ids = torch.randint(0, 64, (2, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 10, dtype=torch.long)
    batch = Batch(ids, ones, ones, hidden, hidden)
    loss, parts = CoralRouterDrafter.training_loss(routed, batch, target, opts)
    loss.backward()
    assert routed.router.proj.weight.grad is not None and set(parts) >= {"router1", "router2", "hit1"}
