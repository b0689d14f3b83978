"""HASS's training-time multi-step forward equals drafting step by step with the head's own KV cache."""
import pytest
import torch
from transformers import DynamicCache

from drafters.hass import HassDrafter, harmonized_steps
from specbench.decode.target import TargetModel
from specbench.decode.tree import harmonized
from tests.helpers import tiny_llama


def test_mask_step_one_is_causal():
    m = harmonized(5, 1, "cpu")
    assert torch.equal(m, torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_training_steps_equal_decoding_with_own_features():
    torch.manual_seed(0)
    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    head = HassDrafter.build_module(target, HassDrafter.options(steps=3)).eval()
    ids = torch.randint(0, 64, (1, 12))
    hidden = target.prefill(ids, target.new_cache()).hidden  # f_0 .. f_11
    emb = target.decoder.embed_tokens(ids[:, 1:])  # e(t_{i+1}), i = 0..10
    n = emb.shape[1]
    with torch.no_grad():
        preds = list(harmonized_steps(head, emb, hidden[:, :-1], torch.ones(1, n, dtype=torch.long), 3))
        for j in (1, 2, 3):
            for root in range(0, n - j + 1):
                cache = DynamicCache(config=head.body.config)
                f = head(emb[:, : root + 1], hidden[:, : root + 1], cache)[:, -1:]  # F at root -> f^_{root+1}
                for k in range(1, j):  # feed own features for the drafted pairs root+1 .. root+j-1
                    pos = torch.tensor([[root + k]])
                    f = head(emb[:, root + k : root + k + 1], f, cache, position_ids=pos)
                i = root + j - 1  # the step-j query position
                torch.testing.assert_close(preds[j - 1][:, i], f[:, 0], atol=1e-5, rtol=1e-4)


def test_each_step_is_its_own_graph_on_detached_inputs_and_losses_sum():
    """The authors' main_hass.py: step j reads step j-1's prediction detached, is backpropagated on its own, and the
    step losses add up; the Top-K term is off before the last `topk_stage` of the steps and on in it."""
    from specbench.train.trainer import Batch

    torch.manual_seed(0)
    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    opts = HassDrafter.options(steps=3, topk=4, topk_stage=0.2)
    head = HassDrafter.build_module(target, opts).train()
    ids = torch.randint(0, 64, (2, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 10, dtype=torch.long)
    batch = Batch(ids, ones, ones, hidden, hidden)
    early = list(HassDrafter.training_steps(head, batch, target, opts, epoch=1, progress=0.79))
    late = list(HassDrafter.training_steps(head, batch, target, opts, epoch=1, progress=0.8))
    assert len(early) == len(late) == 3
    assert not any(k.startswith("top") for _, parts in early for k in parts)
    assert all(f"top{j}" in late[j - 1][1] for j in (1, 2, 3))
    # step 2's gradient equals what a fresh forward on the detached step-1 prediction gives: nothing flows back
    # through step 1 (were it not detached, backward of step 2 would also reach step 1's output)
    pieces = HassDrafter.training_steps(head, batch, target, opts, epoch=0, progress=0.0)
    first, _ = next(pieces)
    head.zero_grad()
    first.backward()
    g1 = head.fc.weight.grad.clone()
    second, _ = next(pieces)
    second.backward()  # would raise if step 2's graph reached step 1's (already freed) graph
    assert not torch.equal(head.fc.weight.grad, g1)
    total, _ = HassDrafter.training_loss(head, batch, target, opts)
    torch.testing.assert_close(total, sum(l for l, _ in late), atol=1e-5, rtol=1e-5)


def test_eagle_head_is_the_authors_layout():
    """SafeAILab/EAGLE cnets.py: layer 0 has no input RMSNorm (an identity, so no weight to load), fc = Linear(2H, H)
    with a bias unless the config says bias: false; the layer's own rms_norm_eps is recorded."""
    from torch import nn

    from drafters.eagle import EagleDrafter

    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    head = EagleDrafter.build_module(target, EagleDrafter.options())
    keys = set(head.state_dict())
    assert isinstance(head.body.layers[0].input_layernorm, nn.Identity)
    assert not any("input_layernorm" in k for k in keys)
    assert {"fc.weight", "fc.bias", "body.layers.0.post_attention_layernorm.weight"} <= keys
    no_bias = EagleDrafter.build_module(target, EagleDrafter.options(bias=False, rms_norm_eps=1e-5))
    assert "fc.bias" not in no_bias.state_dict()
    assert no_bias.body.layers[0].post_attention_layernorm.variance_epsilon == 1e-5


def test_the_top_k_stage_is_the_authors_second_run():
    """train.sh: 40 epochs without the Top-K term, then 10 with it at lr 1e-5 (3e-5 before), from a fresh optimiser:
    a Restart at 4/5 of the budget scaled 1/3; the term switches on at the very step the restart starts."""
    from specbench.core.config import TrainConfig
    from specbench.decode.drafter import Restart
    from specbench.train.trainer import scheduled_lr, stage_starts

    opts = HassDrafter.options()
    assert HassDrafter.restarts(opts) == (Restart(at=0.8, lr_scale=1 / 3),)
    stages = stage_starts(HassDrafter.restarts(opts), 1600)
    assert stages == [(0, 1.0), (1280, 1 / 3)]
    on = [s for s in range(1600) if HassDrafter.topk_on(opts, s / 1600)]
    assert on[0] == 1280 and len(on) == 320
    for total in range(5, 60):  # any budget (0.8 x total not whole): the term and the restart begin at one step
        first = stage_starts(HassDrafter.restarts(opts), total)[1][0]
        assert [s for s in range(total) if HassDrafter.topk_on(opts, s / total)][0] == first
    tc = TrainConfig(lr=3e-4, warmup_steps=20, lr_schedule="cosine")
    assert scheduled_lr(1279, tc, 1600, stages) < 3e-4 * 0.1  # the first stage decays to ~0 at its own end
    assert scheduled_lr(1280, tc, 1600, stages) == pytest.approx(1e-4 / 20)  # warm-up again, to 1e-4
    assert scheduled_lr(1299, tc, 1600, stages) == pytest.approx(1e-4)
    assert HassDrafter.restarts(HassDrafter.options(topk_restart=False)) == ()
    # CORAL is HASS's trainer without the Top-K stage
    from drafters.coral import CoralDrafter
    assert CoralDrafter.restarts(CoralDrafter.options()) == ()


def _authors_loop(q, ks, vs, scale):
    """A literal port of cnets_hass.py's training attention for the query of step j = len(ks): sources s = 0 (the
    target features) .. j-1 (earlier steps' predictions), each masked by its alignment mask, logits multiplied by the
    masks, one softmax over the n positions, probabilities multiplied by the masks again."""
    j, n = len(ks), q.shape[-2]
    masks = []
    for idx in range(j):
        small = torch.tril(torch.ones(n - j + idx + 1, n - j + idx + 1)) if not idx else torch.eye(n - j + idx + 1)
        big = torch.zeros(n, n)
        big[j - idx - 1 :, : n - j + idx + 1] = small
        masks.append(big)
    masks = torch.stack(masks)[:, None, None]  # [j, 1, 1, n, n]
    w = torch.stack([q @ k.transpose(-1, -2) * scale for k in ks])  # [j, B, nh, n, n]
    total = (w * masks).sum(0).softmax(-1)
    return ((total[None] * masks) @ torch.stack(vs)).sum(0)  # [B, nh, n, d]


@pytest.mark.parametrize("j", [1, 2, 3])
def test_the_authors_training_attention_is_their_multiplied_mask(j):
    from types import SimpleNamespace

    from drafters.hass import authors_attention, harmonized_inputs
    from specbench.decode.tree import additive

    torch.manual_seed(j)
    b, nh, n, d = 2, 2, 7, 4
    q = torch.randn(b, nh, n, d)
    ks, vs = [torch.randn(b, nh, n, d) for _ in range(j)], [torch.randn(b, nh, n, d) for _ in range(j)]
    want = _authors_loop(q, ks, vs, d ** -0.5)
    allowed = harmonized(n, j, "cpu")[(j - 1) * n :]  # the step-j queries over the concatenated steps
    mask = additive(allowed[None, None].expand(b, 1, -1, -1), torch.float32)
    hidden = (n - allowed.sum(-1)).float()[None, None].expand(b, 1, -1)
    got, _ = authors_attention(SimpleNamespace(num_key_value_groups=1), q, torch.cat(ks, 2), torch.cat(vs, 2), mask,
                               scaling=d ** -0.5, zero_logits=hidden)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    # the same counts as the training forward computes them (padding included: a pad is one more hidden position)
    emb = torch.zeros(b, n, 3)
    pad = torch.ones(b, n, dtype=torch.long)
    pad[1, -2:] = 0
    *_, counts = harmonized_inputs(emb, [emb] * j, pad, zero_logits=True)
    assert torch.equal(counts[0, 0, (j - 1) * n :], hidden[0, 0])
    assert torch.all(counts[1, 0] >= counts[0, 0]) and torch.any(counts[1, 0] > counts[0, 0])


def test_the_authors_training_attention_trains_and_drafting_stays_additive():
    torch.manual_seed(0)
    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    authors = HassDrafter.build_module(target, HassDrafter.options(steps=2))  # the default
    plain = HassDrafter.build_module(target, HassDrafter.options(steps=2, train_attention="additive"))
    plain.load_state_dict(authors.state_dict())
    ids = torch.randint(0, 64, (1, 10))
    hidden = target.prefill(ids, target.new_cache()).hidden
    emb, pad = target.decoder.embed_tokens(ids[:, 1:]), torch.ones(1, 9, dtype=torch.long)
    with torch.no_grad():
        a = list(harmonized_steps(authors, emb, hidden[:, :-1], pad, 2, attention="authors"))
        p = list(harmonized_steps(plain, emb, hidden[:, :-1], pad, 2, attention="additive"))
        # the hidden positions' weight changes every query but the last of step 1 (it sees every position)
        assert not torch.allclose(a[0][:, :-1], p[0][:, :-1]) and torch.allclose(a[0][:, -1], p[0][:, -1], atol=1e-5)
        # drafting (no zero_logits) is the additive form on either module
        torch.testing.assert_close(authors(emb, hidden[:, :-1]), plain(emb, hidden[:, :-1]))
    with pytest.raises(ValueError, match="use_authors_attention"):
        next(harmonized_steps(plain, emb, hidden[:, :-1], pad, 2, attention="authors"))
    with pytest.raises(ValueError, match="train_attention='both'"):
        HassDrafter.build_module(target, HassDrafter.options(train_attention="both"))
    # decoding drops the training-only option: a checkpoint trained either way decodes with the same module, on SDPA
    assert "train_attention" not in HassDrafter.decoding_options({"train_attention": "authors", "bias": True})
    assert HassDrafter.load_module(target, None, {"train_attention": "authors"}).body.config._attn_implementation == "sdpa"


def authors_loss_masks(answers: list[list[int]], width: int) -> torch.Tensor:
    """SafeAILab/EAGLE eagle/train/main.py, transcribed: each sequence's loss_mask as its data gives it (1 on answer
    tokens), `loss_mask[-1] = 0` (the last token's target is the zero padding), right-padded with 0 to the batch's
    width; position j's prediction reads hidden[j] and t_{j+1} and targets hidden[j+1]."""
    rows = []
    for m in answers:
        m = list(m)
        m[-1] = 0
        rows.append(m + [0] * (width - len(m)))
    return torch.tensor(rows)


@pytest.mark.parametrize("name", ["eagle", "hass", "coral"])
def test_the_authors_loss_mask_is_their_main_py(name):
    """module.loss_mask=authors trains the positions of their main.py (transcribed above), ours those whose predicted
    token t_{i+2} is an answer token; every drafter of the family trains on the option's positions."""
    from drafters.coral import CoralDrafter
    from drafters.eagle import EagleDrafter, trained_positions
    from specbench.errors import SpecbenchError
    from specbench.train.trainer import Batch

    answers = [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]  # a full-width row and a right-padded one (T = 7)
    loss = torch.tensor([a + [0] * (7 - len(a)) for a in answers])
    real = torch.tensor([[1] * len(a) + [0] * (7 - len(a)) for a in answers])
    theirs = authors_loss_masks(answers, 7)[:, :-1]  # i = 0 .. T-2 (their j = T-1 is always 0)
    assert torch.equal(trained_positions(loss, real, "authors").int(), theirs)
    assert trained_positions(loss, real).int().tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]  # t_{i+2}
    assert theirs.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    cls = {"eagle": EagleDrafter, "hass": HassDrafter, "coral": CoralDrafter}[name]
    with pytest.raises(SpecbenchError, match="loss_mask='inputs'"):
        cls.options(loss_mask="inputs")

    torch.manual_seed(0)
    target = TargetModel(tiny_llama(vocab=64, layers=2, seed=1), None, torch.device("cpu"), "tiny")
    head = cls.build_module(target, cls.options()).eval()
    ids = torch.randint(0, 64, (2, 12))
    hidden = target.prefill(ids, target.new_cache()).hidden
    ones = torch.ones(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 4:10], mask[1, 7:10] = 1, 1  # no answer token at T-2, T-1: theirs trains no i past T-3 (ours cannot)

    def loss_of(m, form):
        with torch.no_grad():
            return cls.training_loss(head, Batch(ids, m, ones, hidden, hidden), target, cls.options(loss_mask=form))[0]

    later = torch.zeros_like(mask)  # ours on a mask that marks t_{i+2} wherever theirs trains i
    later[:, 2:] = mask[:, :-2]
    torch.testing.assert_close(loss_of(mask, "authors"), loss_of(later, "predicted"))
    assert not torch.allclose(loss_of(mask, "authors"), loss_of(mask, "predicted"))
