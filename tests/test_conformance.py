"""Every conf/drafter/*.yaml, on tiny random Llama targets: greedy SD output == the target's greedy output token for
token (several prompts, EOS inside a drafted tree, max_new_tokens reached mid-tree), and the drafter's proposals
depend only on the verified tokens (its rollback is right) over many steps."""
from pathlib import Path

import pytest
import torch

from specbench.decode.drafter import HIDDEN, KV, LAYERS, Drafter
from specbench.decode.engine import Engine
from specbench.decode.target import TargetModel, cache_kv
from specbench.decode.types import SamplingParams, TargetState
from specbench.tools import gpu_check
from tests.helpers import RandomTreeDrafter, engine_greedy, hf_greedy, tiny_llama

CONF = Path(__file__).resolve().parents[1] / "conf" / "drafter"
DRAFTER_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml"))
PROMPTS = [[5, 17, 33, 17, 33, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [60, 61, 60, 61, 60]]


def make_drafter(name: str, target: TargetModel, *overrides: str) -> Drafter:
    """The config as composed by Hydra (with `overrides`), except trained weights: those belong to the embedded
    target, these targets are tiny (an untrained module of the same shape goes through the same code)."""
    return gpu_check.make_drafter(name, target, *overrides)


def target_for(eos: int | None = None, seed: int = 0) -> TargetModel:
    return TargetModel(tiny_llama(seed=seed, eos=eos, scale=20.0), None, torch.device("cpu"), "tiny")


def test_every_drafter_config_is_covered():
    assert {"none", "pld", "sd"} <= set(DRAFTER_CONFIGS)


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_greedy_lossless_several_prompts(name):
    target = target_for()
    drafter = make_drafter(name, target)
    for prompt in PROMPTS:
        ref = hf_greedy(target.model, prompt, 60)
        assert engine_greedy(target, drafter, prompt, 60) == ref


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_reached_mid_tree(name, max_new):
    target = target_for()
    drafter = make_drafter(name, target)
    for prompt in PROMPTS[:2]:
        out = engine_greedy(target, drafter, prompt, max_new)
        assert out == hf_greedy(target.model, prompt, max_new)
        assert len(out) == max_new


@pytest.mark.parametrize("name", DRAFTER_CONFIGS + ["random-tree"])
def test_eos_inside_a_drafted_tree(name):
    prompt = PROMPTS[0]
    free = hf_greedy(target_for().model, prompt, 40)
    # make a token that first appears mid-continuation the EOS: generation must stop right there
    k = next(i for i in range(8, 40) if free[i] not in free[:i])
    target = target_for(eos=free[k])
    drafter = (RandomTreeDrafter(128, free, seed=1) if name == "random-tree" else make_drafter(name, target))
    out = engine_greedy(target, drafter, prompt, 40)
    assert out == hf_greedy(target.model, prompt, 40) == free[: k + 1]


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_are_lossless(seed):
    """Trees with siblings and non-contiguous accepted paths exercise the tree mask and the cache gather."""
    target = target_for(seed=seed)
    for prompt in PROMPTS:
        ref = hf_greedy(target.model, prompt, 50)
        drafter = RandomTreeDrafter(128, ref, seed=seed)
        gen = Engine(target, drafter, SamplingParams()).generate(prompt, 50)
        assert gen.new_tokens == ref
        assert gen.tau > 1.3  # the oracle part of the trees is accepted: multi-token steps really happened


class Recorder(Drafter):
    def __init__(self, inner: Drafter):
        self.inner, self.needs, self.log = inner, inner.needs, []
        self.hidden_layers = inner.hidden_layers

    def prefill(self, state):
        self.inner.prefill(state)

    def propose(self, state):
        tree = self.inner.propose(state)
        self.log.append((state.tokens.clone(), tree.tokens.clone(), tree.parents.clone()))
        return tree

    def on_verified(self, state):
        self.inner.on_verified(state)


@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_drafter_state_rolls_back_over_many_steps(name):
    """After any number of steps, a drafter proposes what a fresh one prefilled on the same verified tokens does."""
    target = target_for()
    rec = Recorder(make_drafter(name, target))
    Engine(target, rec, SamplingParams()).generate(PROMPTS[1], 120)
    assert len(rec.log) >= 10
    for tokens, tree_tokens, tree_parents in rec.log[:: max(1, len(rec.log) // 8)]:
        cache = target.new_cache()
        fresh = make_drafter(name, target)
        fwd = target.prefill(tokens[:, :-1], cache, layers=tuple(fresh.hidden_layers))
        state = TargetState(tokens=tokens, hidden=fwd.hidden if HIDDEN in fresh.needs else None,
                            kv=cache_kv(cache) if KV in fresh.needs else None,
                            layers=fwd.layers if LAYERS in fresh.needs else None)
        fresh.prefill(state)
        again = fresh.propose(state)
        assert torch.equal(again.tokens, tree_tokens) and torch.equal(again.parents, tree_parents)


class Probe(RandomTreeDrafter):
    """Random trees, and a log of what the engine hands over after each step (a one-row drafter: OneRow)."""

    needs = frozenset({HIDDEN, KV})
    batched = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def on_verified(self, state):
        kv = [(k.clone(), v.clone()) for k, v in state.kv]
        self.seen.append((state.tokens.clone(), state.hidden.clone(), kv, state.fresh[0] - 1))


@pytest.mark.parametrize("seed", range(3))
def test_hidden_states_and_compacted_cache_equal_a_plain_forward(seed):
    """After gathers of non-contiguous accepted nodes, the target cache and the accepted-path hidden states are exactly
    those of an ordinary causal forward over the verified tokens."""
    target = target_for(seed=seed)
    ref = hf_greedy(target.model, PROMPTS[0], 40)
    probe = Probe(128, ref, seed=seed)
    Engine(target, probe, SamplingParams()).generate(PROMPTS[0], 40)
    assert any(n >= 2 for *_, n in probe.seen)
    for tokens, hidden, kv, n_acc in probe.seen:
        cache = target.new_cache()
        fwd = target.prefill(tokens[:, :-1], cache)  # the cache holds every verified token but the root
        t = tokens.shape[1]
        assert hidden.shape[1] == n_acc + 1
        torch.testing.assert_close(hidden, fwd.hidden[:, t - 2 - n_acc : t - 1], atol=1e-4, rtol=1e-4)
        for (k, v), (k0, v0) in zip(kv, cache_kv(cache)):
            torch.testing.assert_close(k, k0, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, v0, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["pld", "sd", "eagle2", "medusa", "moa_tli1"])
def test_a_target_placed_by_a_device_map_decodes_losslessly(name, tiny_checkpoint):
    """model.device_map (accelerate, as a 70B target across GPUs loads): every layer mapped, here all to `cpu`, through
    the same loading and decoding path; drafters that read hidden states, the target's K/V and its last layer."""
    import json

    from specbench.core.config import ModelConfig
    from specbench.core.models import load_model

    layers = json.loads((tiny_checkpoint / "config.json").read_text())["num_hidden_layers"]
    dmap = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(layers)}, "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model, tok, dev = load_model(ModelConfig(name="tiny", hf_id="tiny", path=str(tiny_checkpoint), device="cpu",
                                             device_map=dmap))
    assert dev == torch.device("cpu") and all(p.device == dev for p in model.parameters())
    target = TargetModel(model, tok, dev, "tiny")
    drafter = make_drafter(name, target)
    for prompt in PROMPTS:
        assert engine_greedy(target, drafter, prompt, 40) == hf_greedy(model, prompt, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", DRAFTER_CONFIGS)
def test_every_drafter_decodes_in_the_targets_half_precision(name, dtype):
    """On a bf16/fp16 target every drafter drafts in the target's dtype (as its authors cast theirs) and decodes;
    before, trained modules stayed fp32 next to it (Medusa crashed: "mat1 and mat2 must have the same dtype")."""
    target = target_for()
    target.model.to(dtype)
    drafter = make_drafter(name, target)
    module = next((m for m in vars(drafter).values() if isinstance(m, torch.nn.Module)), None)
    if module is not None:
        assert {p.dtype for p in module.parameters() if p.is_floating_point()} == {dtype}, name
    baseline = make_drafter("none", target)
    for prompt in PROMPTS[:2]:
        assert engine_greedy(target, drafter, prompt, 40) == engine_greedy(target, baseline, prompt, 40)


@pytest.mark.parametrize("name", ["random-tree", "eagle2", "sd"])
def test_trees_past_the_context_are_not_verified(name):
    """A tree whose nodes would sit past the target's last position is dropped: that step decodes one token (lossless),
    the drafter rolls its nodes back, and the output is the target's up to the context."""
    target = target_for()
    drafter = RandomTreeDrafter(target.vocab_size, seed=1) if name == "random-tree" else make_drafter(name, target)
    prompt = PROMPTS[1]
    context = len(prompt) + 100  # eagle2's trees have 60 nodes
    gen = Engine(target, drafter, SamplingParams()).generate(prompt, 100, None, context)
    assert gen.new_tokens == hf_greedy(target.model, prompt, 100)
    assert gen.tree_sizes[-1] == 0 and max(gen.tree_sizes) > 0  # the last steps verified no tree
