"""MoA: the authors' blocks and curriculum, their K/V layout, and training-time prediction == the decoding path (LSA,
SA, CA, TLI caches)."""
import pytest
import torch

from drafters.moa import MoADrafter, block_starts, staircase_rows
from drafters.trees import Grown, Level
from specbench.errors import SpecbenchError
from specbench.decode.target import TargetModel, cache_kv, kv_per_token
from specbench.decode.types import TargetState
from tests.helpers import tiny_llama

OPTS = dict(lsa_mlp=48, sa_mlp=16, ca_mlp=48)


def test_blocks_start_at_every_non_answer_position_and_every_nth_answer_position():
    """The authors' response_mask_noisy: a block starts at i % every == 0 and wherever the loss mask is 0; start(i)
    is the last block start at or before i (a block-start query sees its own activation)."""
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    starts = block_starts(mask, torch.tensor([6]))
    assert starts[0].tolist() == [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 6, 6, 12, 12, 14, 15]
    every = torch.randint(6, 15, (64,), generator=torch.Generator().manual_seed(0))
    assert set(every.tolist()) == set(range(6, 15))  # randint(6, 15): 6..14
    s = block_starts(torch.ones(64, 200, dtype=torch.long), every)
    assert (s <= torch.arange(200)).all() and (torch.arange(200) - s < every[:, None]).all()


def test_the_staircase_fades_out_by_half_the_budget():
    torch.manual_seed(0)
    assert staircase_rows(1000, 0.0, 0.5, "cpu").all()
    assert not staircase_rows(1000, 0.5, 0.5, "cpu").any()
    assert 0.4 < staircase_rows(4000, 0.25, 0.5, "cpu").float().mean() < 0.6


def test_the_staircase_in_stairs_is_the_authors_fade_by_epoch():
    """stairs = E: the probability of a causal SA is (the epoch's start) / until, as theirs epoch / (max_epochs / 2)."""
    torch.manual_seed(0)
    # the budget's 2 epochs: all of epoch 1 staircased, none of epoch 2
    assert staircase_rows(1000, 0.0, 0.5, "cpu", stairs=2).all() and staircase_rows(1000, 0.49, 0.5, "cpu", stairs=2).all()
    assert not staircase_rows(1000, 0.5, 0.5, "cpu", stairs=2).any()
    # their 40 epochs: epoch 5 (progress 5/40 .. 6/40) is causal with probability 5 / 20
    for progress in (5 / 40, 5.9 / 40):
        assert 0.71 < staircase_rows(8000, progress, 0.5, "cpu", stairs=40).float().mean() < 0.79
    with pytest.raises(SpecbenchError, match="staircase_stairs"):
        MoADrafter.options(staircase_stairs=-1)


def test_kv_rows_interleave_keys_and_values_per_head_as_the_authors_do():
    k, v = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)  # [B, heads, T, dh]
    theirs = torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).reshape(1, 5, -1)
    assert torch.equal(kv_per_token(k, v), theirs)


def setup(tli: int, t: int = 16):
    target = TargetModel(tiny_llama(vocab=64, layers=3, seed=1), None, torch.device("cpu"), "tiny")
    torch.manual_seed(0)
    net = MoADrafter.build_module(target, MoADrafter.options(tli=tli, **OPTS)).eval()
    ids = torch.randint(0, 64, (1, t))
    cache = target.new_cache()
    target.forward(ids, cache, logits_rows=slice(0, 0))
    kv = torch.stack([kv_per_token(k[0], v[0]) for k, v in cache_kv(cache)], 1)[None]  # [1, T, L, 2E_kv]
    return target, net, ids, kv


class Forced:
    """A tree policy that drafts `tokens` [A, k] as a chain whatever the logits, keeping the logits of every row fed to
    the drafter (the root's, then each drafted token's): teacher forcing through the decoding path."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.max_nodes, self.logits = tokens, tokens.shape[1], []

    def prepare(self, device):
        pass

    def expanded(self, vocab: int) -> int:
        return self.max_nodes

    def grow_rows(self, root_logits: torch.Tensor, expand) -> Grown:
        self.logits.append(root_logits)
        a, k = self.tokens.shape
        for i in range(k):
            node = torch.full((a, 1), i)
            self.logits.append(expand(Level(node, self.tokens[:, i : i + 1], node - 1, i + 1))[:, 0])
        return Grown(self.tokens, torch.arange(-1, k - 1).expand(a, k), is_chain=True)


def forced_logits(d: MoADrafter, target, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The drafter's logits through its decoding path for the root ids[n] (the target's cache holding ids[:n]) and the
    k tokens after it drafted as a chain -> [k + 1, V]."""
    prefix = target.new_cache()
    target.forward(ids[:, :n], prefix, logits_rows=slice(0, 0))
    state = TargetState(tokens=ids[:, : n + 1], hidden=None, kv=cache_kv(prefix))
    policy, d.policy = d.policy, Forced(ids[:, n + 1 : n + 1 + k])
    d.prefill_rows(state)
    d.propose_rows(state)
    forced, d.policy = d.policy, policy
    return torch.cat(forced.logits)


@pytest.mark.parametrize("tli", [0, 1, 2])
def test_training_prediction_equals_drafting(tli):
    target, net, ids, kv = setup(tli)
    t = ids.shape[1]
    mask = torch.ones(1, t, dtype=torch.long)
    mask[0, :3] = 0
    starts = block_starts(mask, torch.tensor([5]))
    with torch.no_grad():
        _, _, logits = MoADrafter.predict(net, target, ids, kv, torch.ones(1, t, dtype=torch.long), starts)
    d = MoADrafter(target, net=net)
    checked = 0
    for n in sorted(set(starts[0].tolist())):  # every block: activations up to n, queries n+1 ..
        block = [i for i in range(t) if starts[0, i] == n and i > n]  # (a block start sees itself: never drafted)
        if block:  # the root n+1, then the block's tokens drafted as a chain
            got = forced_logits(d, target, ids, n + 1, len(block) - 1)
            torch.testing.assert_close(got, logits[0, block], atol=1e-4, rtol=1e-4)
            checked += len(block)
    assert checked >= 8


@pytest.mark.parametrize("tli", [1, 2])
def test_a_block_start_takes_the_true_tli_input_as_the_authors_forward_does(tli):
    """With the target's true input of the first TLI layer, a block start's TLI layers see the true K/V up to itself
    and the true input, so its logits are the target's own, and its final loss sends no gradient to the drafter's
    prediction there; inside a block the prediction is used as before."""
    target, net, ids, kv = setup(tli)
    t = ids.shape[1]
    starts = block_starts(torch.ones(1, t, dtype=torch.long), torch.tensor([5]))
    at_start = starts[0] == torch.arange(t)
    with torch.no_grad():
        res = target.decoder(input_ids=ids, output_hidden_states=True)
        true_in = res.hidden_states[len(target.decoder.layers) - tli]  # [1, T, E]
        theirs = target.lm_head(res.last_hidden_state)[0]
    real = torch.ones(1, t, dtype=torch.long)
    out, final, logits = MoADrafter.predict(net, target, ids, kv, real, starts, tli_input=true_in)
    torch.testing.assert_close(logits[0, at_start], theirs[at_start], atol=1e-4, rtol=1e-4)
    _, _, plain = MoADrafter.predict(net, target, ids, kv, real, starts)
    torch.testing.assert_close(logits[0, ~at_start], plain[0, ~at_start])
    assert not torch.allclose(plain[0, at_start], theirs[at_start], atol=1e-2)  # the input really was replaced
    params = list(net.parameters())
    assert final[0, ~at_start].requires_grad  # (inside a block the drafter's prediction is trained)
    picked = final[0, at_start].sum()
    grads = torch.autograd.grad(picked, params, allow_unused=True) if picked.requires_grad else [None] * len(params)
    assert all(g is None or not g.any() for g in grads)


def test_the_staircase_sa_sees_only_its_block():
    """With the staircase the SA output of a query does not depend on tokens before its block."""
    target, net, ids, kv = setup(0)
    t = ids.shape[1]
    starts = block_starts(torch.ones(1, t, dtype=torch.long), torch.tensor([6]))
    other = ids.clone()
    other[0, 1:6] = (other[0, 1:6] + 1) % 64  # change tokens of the first block only
    real = torch.ones(1, t, dtype=torch.long)
    with torch.no_grad():
        a = MoADrafter.predict(net, target, ids, kv, real, starts, torch.tensor([True]))[0]
        b = MoADrafter.predict(net, target, other, kv, real, starts, torch.tensor([True]))[0]
        c = MoADrafter.predict(net, target, other, kv, real, starts, torch.tensor([False]))[0]
    torch.testing.assert_close(a[0, 6:], b[0, 6:])
    assert not torch.allclose(a[0, 6:], c[0, 6:])


def test_lsa_attends_across_every_layer_and_the_tli_loss_has_both_terms():
    target, net, ids, kv = setup(1)
    x = kv[0, :2]  # [2 tokens, L, 2E_kv]
    with torch.no_grad():
        base = net.lsa(x)
        y = x.clone()
        y[:, -1] += 1.0  # the last layer's K/V changes the first layer's row too (bidirectional), hence the mean
        first = net.layer_self_attention(x, attention_mask=torch.zeros(1, 1, 3, 3), position_ids=torch.arange(3)[None],
                                         position_embeddings=net.lsa_rotary(x, torch.arange(3)[None]))
        first2 = net.layer_self_attention(y, attention_mask=torch.zeros(1, 1, 3, 3),
                                          position_ids=torch.arange(3)[None],
                                          position_embeddings=net.lsa_rotary(y, torch.arange(3)[None]))
    assert not torch.allclose(first[:, 0], first2[:, 0])
    torch.testing.assert_close(base, net.Ekv2E(first.mean(1)))
    from specbench.train.trainer import Batch

    t = ids.shape[1]
    cache = target.new_cache()
    res = target.decoder(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    mask = torch.ones(1, t, dtype=torch.long)
    batch = Batch(ids, mask, mask, res.last_hidden_state, res.last_hidden_state)
    batch.kv, batch.pre = kv, torch.stack([res.hidden_states[-2]], 2)
    loss, parts = MoADrafter.training_loss(net.train(), batch, target, MoADrafter.options(tli=1, **OPTS))
    total = 0.1 * parts["ce"] + 0.5 * parts["feat"] + 0.5 * parts["prev_feat"]
    assert loss.item() == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize(("shape", "widths", "want"), [
    # Llama-3-8B (E 4096, 32 heads, 8 KV heads of 128; LSA 2048 = 32 heads of 64): the authors' yaml, then Table 6
    ((4096, 32, 8, 2048, 32), "code", dict(sa_kv_heads=4, sa_mlp=6144, ca_kv_heads=4, ca_mlp=6144, lsa_kv_heads=8,
                                            lsa_mlp=3072)),
    ((4096, 32, 8, 2048, 32), "table6", dict(sa_kv_heads=4, sa_mlp=512, ca_kv_heads=8, ca_mlp=7168, lsa_kv_heads=16,
                                              lsa_mlp=6144)),
    # SmolLM2 (E 576, 9 heads, 3 KV heads of 64; LSA 384 = 6 heads of 64): conf/drafter/moa.yaml's comment
    ((576, 9, 3, 384, 6), "code", dict(sa_kv_heads=1, sa_mlp=864, ca_kv_heads=1, ca_mlp=864, lsa_kv_heads=2,
                                        lsa_mlp=576)),
    ((576, 9, 3, 384, 6), "table6", dict(sa_kv_heads=1, sa_mlp=72, ca_kv_heads=3, ca_mlp=1008, lsa_kv_heads=3,
                                          lsa_mlp=1152)),
])
def test_the_widths_are_the_authors_code_or_table_6_scaled_to_the_target(shape, widths, want):
    from drafters.moa import MoAOptions, resolve_widths

    assert resolve_widths(MoAOptions(widths=widths), *shape) == want
    assert resolve_widths(MoAOptions(widths=widths, sa_mlp=100), *shape)["sa_mlp"] == 100  # a set width wins
    with pytest.raises(ValueError, match="widths='paper'"):
        resolve_widths(MoAOptions(widths="paper"), *shape)


def test_the_pre_tli_loss_is_zero_at_block_starts():
    from specbench.train.trainer import Batch

    target, net, ids, kv = setup(1)
    t = ids.shape[1]
    res = target.decoder(input_ids=ids, use_cache=False, output_hidden_states=True)
    mask = torch.ones(1, t, dtype=torch.long)
    batch = Batch(ids, mask, mask, res.last_hidden_state, res.last_hidden_state)
    batch.kv, batch.pre = kv, torch.stack([res.hidden_states[-2]], 2)
    opts = dict(tli=1, **OPTS, staircase=False)
    with torch.no_grad():
        _, every = MoADrafter.training_loss(net, batch, target, MoADrafter.options(block_min=1, block_max=1, **opts))
        _, some = MoADrafter.training_loss(net, batch, target, MoADrafter.options(block_min=4, block_max=4, **opts))
    assert every["prev_feat"] == 0.0 and some["prev_feat"] > 0.0  # blocks of 1: every position starts one


def test_per_sequence_weighting_is_the_mean_of_each_sequences_own_loss():
    """loss_weighting=sequence: a batch of two answers of 13 and 4 tokens trains as the mean of the two one-sequence
    batches' losses (the authors' one sequence per micro-batch), where `token` weighs the longer answer 13:4."""
    from drafters.distill import per_sequence_weights
    from specbench.train.trainer import Batch

    rows = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert per_sequence_weights(rows).tolist() == pytest.approx([1 / 6] * 3 + [1 / 2])  # an empty row counts nothing

    target, net, ids, kv = setup(1)
    t = ids.shape[1]
    res = target.decoder(input_ids=ids, use_cache=False, output_hidden_states=True)
    answers = torch.zeros(2, t, dtype=torch.long)
    answers[0, 3:], answers[1, 12:] = 1, 1

    def batch(r: slice) -> Batch:
        b = Batch(ids.expand(2, t)[r], answers[r], torch.ones(2, t, dtype=torch.long)[r],
                  res.last_hidden_state.expand(2, -1, -1)[r], res.last_hidden_state.expand(2, -1, -1)[r])
        b.kv, b.pre = kv.expand(2, -1, -1, -1)[r], torch.stack([res.hidden_states[-2]], 2).expand(2, -1, -1, -1)[r]
        return b

    def loss(r: slice, weighting: str) -> float:
        opts = MoADrafter.options(tli=1, **OPTS, staircase=False, block_min=4, block_max=4, loss_weighting=weighting)
        with torch.no_grad():
            return MoADrafter.training_loss(net, batch(r), target, opts)[0].item()

    one, other = loss(slice(0, 1), "token"), loss(slice(1, 2), "token")
    assert loss(slice(0, 2), "sequence") == pytest.approx((one + other) / 2, rel=1e-5)
    assert loss(slice(0, 2), "token") == pytest.approx((13 * one + 4 * other) / 17, rel=1e-5)
    assert abs(one - other) > 1e-3  # (so the two weightings differ here)
    with pytest.raises(SpecbenchError, match="loss_weighting='row'"):
        MoADrafter.options(loss_weighting="row")


def test_tli_drafting_without_the_targets_cache_is_the_authors_and_lossless():
    from drafters.layers import target_layer
    from tests.helpers import engine_greedy, hf_greedy

    target, net, ids, kv = setup(1)
    tree = {"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8}
    ours = MoADrafter(target, net=net, tree=tree)
    theirs = MoADrafter(target, net=net, module={"tli_context": "none"}, tree=tree)
    n = ids.shape[1] - 1
    seen = []
    hook = net.cross_attention.register_forward_hook(lambda m, i, out: seen.append(out))
    with torch.no_grad():
        logits = {name: forced_logits(d, target, ids, n, 0)[0] for name, d in (("ours", ours), ("theirs", theirs))}
        # theirs by hand: the root's o^ through the last target layer over itself alone, the final norm, the LM head
        o = seen[-1]  # [1, 1, E]
        empty = torch.zeros(1, target.model.config.num_key_value_heads, 0, target.decoder.layers[-1].self_attn.head_dim)
        x, _, _ = target_layer(target.decoder.layers[-1], target.decoder.rotary_emb, o, torch.tensor([[n]]), empty,
                               empty, torch.ones(1, 1, 1, 1, dtype=torch.bool))
        want = target.lm_head(target.decoder.norm(x))[0, 0]
    hook.remove()
    torch.testing.assert_close(logits["theirs"], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits["ours"], logits["theirs"])  # ours also sees the target's cached K/V
    prompt = ids[0, :8].tolist()
    assert engine_greedy(target, theirs, prompt, 24) == hf_greedy(target.model, prompt, 24)
    with pytest.raises(Exception, match="tli_context='cache'"):
        MoADrafter(target, net=net, module={"tli_context": "cache"})


def test_options_recorded_before_the_width_sets_rebuild_at_table_6():
    """Checkpoints (and run records) from before `widths` existed were shaped by Table 6's ratios."""
    from drafters.moa import resolve_widths

    old = {"tli": 1, "sa_mlp": 72, "ca_mlp": 1008, "lsa_mlp": 1152, "lsa_kv_heads": None, "ca_kv_heads": None,
           "sa_kv_heads": 1, "lsa_head_dim": 64, "staircase": True}
    opts = MoADrafter.options(MoADrafter.decoding_options(old))
    assert opts.widths == "table6" and resolve_widths(opts, 576, 9, 3, 384, 6)["ca_kv_heads"] == 3
    assert MoADrafter.options(MoADrafter.decoding_options({**old, "widths": "code"})).widths == "code"


def test_a_run_drafting_without_the_tli_context_is_named_apart():
    """tli_context shapes nothing, but `none` drafts differently from `target`: its runs get their own name (they were
    resumed as the `target` run's, finished, before), while `target`, the default, keeps the names runs have."""
    from specbench.bench.run import run_key, run_name

    drafter = {"_target_": "drafters.moa.MoADrafter", "name": "moa_tli1", "module": {"tli": 1, "widths": "code"}}
    name = lambda module: run_name(run_key({"name": "m"}, {**drafter, "module": {**drafter["module"], **module}},  # noqa: E731
                                           {"name": "d"}, {"temperature": 0.0}, 1, 0))
    assert name({"tli_context": "target"}) == name({}) != name({"tli_context": "none"})
    assert name({"block_min": 3}) == name({})  # a training option is not the run's
    assert MoADrafter.options(MoADrafter.decoding_options({"tli": 1, "tli_context": "none"})).tli_context == "none"


@pytest.mark.parametrize("tli", [1, 2])
def test_the_authors_tli_training_is_one_causal_pass_over_the_tli_input(tli):
    """tli_training=causal, the authors' moa_spec.py: the TLI input (o^, the true input at block starts) runs through
    the target's last TLI layers as transformers runs them, one causal pass, no target K/V; `drafting` differs."""
    target, net, ids, kv = setup(tli)
    t = ids.shape[1]
    starts = block_starts(torch.ones(1, t, dtype=torch.long), torch.tensor([5]))
    at_start = (starts[0] == torch.arange(t))[None, :, None]
    real = torch.ones(1, t, dtype=torch.long)
    with torch.no_grad():
        true_in = target.decoder(input_ids=ids, output_hidden_states=True).hidden_states[len(target.decoder.layers) - tli]
        out, _, logits = MoADrafter.predict(net, target, ids, kv, real, starts, tli_input=true_in, tli_causal=True)
        x, pos = torch.where(at_start, true_in, out), torch.arange(t)[None]
        mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]  # theirs: attention_mask_tli
        for layer in target.decoder.layers[len(target.decoder.layers) - tli:]:
            y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=target.decoder.rotary_emb(x, pos))
            x = y[0] if isinstance(y, tuple) else y
        theirs = target.lm_head(target.decoder.norm(x))
        torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=1e-4)
        _, _, drafting = MoADrafter.predict(net, target, ids, kv, real, starts, tli_input=true_in)
    assert not torch.allclose(drafting[0, ~at_start[0, :, 0]], theirs[0, ~at_start[0, :, 0]], atol=1e-3)
    with pytest.raises(SpecbenchError, match="tli_training='both' is not one of drafting, causal"):
        MoADrafter.options(tli=1, tli_training="both")
