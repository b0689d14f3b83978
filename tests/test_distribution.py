"""T>0: speculative sampling through the engine preserves the target distribution (vocabulary of 8).

The exact law of the 2nd and 3rd generated tokens (both decided by tree verification, the 1st comes from prefill) is
enumerated from the target; the engine's samples must pass a chi-square test against it, and their total-variation
gap must shrink as samples grow. A negative control shows the test rejects a wrong distribution (the draft model's)."""
import itertools
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from drafters.coral import CoralRouterDrafter
from drafters.eagle import EagleDrafter
from drafters.medusa import MedusaDrafter
from drafters.pld import PromptLookup
from drafters.sd import IndependentDrafter
from specbench.decode.engine import Engine
from specbench.decode.sampling import logits_to_probs
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams
from specbench.decode.vocab import save_counts
from tests.helpers import RandomTreeDrafter, tiny_llama

V = 8
PROMPT = [1, 2, 3, 1, 2]


def target() -> TargetModel:
    return TargetModel(tiny_llama(vocab=V, layers=6, seed=3, scale=30.0), None, torch.device("cpu"), "tiny8")


@torch.inference_mode()
def exact_law(t: TargetModel, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) under the sampling params."""
    def probs(seq):
        return logits_to_probs(t.model(torch.tensor([seq])).logits[0, -1], params)

    law: dict[tuple[int, int], float] = Counter()
    p1 = probs(PROMPT)
    for x1 in range(V):
        p2 = probs(PROMPT + [x1])
        for x2 in range(V):
            p3 = probs(PROMPT + [x1, x2])
            for x3 in range(V):
                law[(x2, x3)] += float(p1[x1] * p2[x2] * p3[x3])
    return law


def seeded(cls, t, **kw):
    torch.manual_seed(0)  # untrained heads: random but fixed
    return cls(t, **kw)


def config_drafter(name: str, t: TargetModel):
    """conf/drafter/<name>.yaml's drafter, untrained (seeded: random but fixed), on this target."""
    from specbench.tools.gpu_check import make_drafter

    return make_drafter(name, t, "tree.depth=3", "tree.topk=3", "tree.total_tokens=8")


def counts(t: TargetModel) -> Path:
    """Token counts ranking ids 6, 1, 4 first (specbench.vocab's file), in a fresh temporary directory."""
    path = Path(tempfile.mkdtemp()) / "token_counts.safetensors"
    return save_counts(path, torch.tensor([0, 5, 0, 0, 3, 0, 9, 0]), t, "test")


def samples(t: TargetModel, drafter, params: SamplingParams, n: int, seed: int) -> Counter:
    eng = Engine(t, drafter, params)
    out: Counter = Counter()
    for i in range(n):
        toks = eng.generate(PROMPT, 3, torch.Generator().manual_seed(seed * 1_000_003 + i)).new_tokens
        out[(toks[1], toks[2])] += 1
    return out


def chi2_pvalue(counts: Counter, law: dict, n: int) -> float:
    """Pearson chi-square, cells with expected count < 5 pooled into one."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0.0, 0.0
    for cell in itertools.product(range(V), range(V)):
        e = law[cell] * n
        if e < 5:
            pool_obs, pool_exp = pool_obs + counts[cell], pool_exp + e
            continue
        stat += (counts[cell] - e) ** 2 / e
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def tv(counts: Counter, law: dict, n: int) -> float:
    return 0.5 * sum(abs(counts[c] / n - law[c]) for c in itertools.product(range(V), range(V)))


DRAFTERS = {
    "eagle2-dynamic-tree": lambda t: seeded(EagleDrafter, t, tree={"kind": "dynamic", "depth": 3, "topk": 3,
                                                                    "total_tokens": 8}),
    # the router leaves most of the vocabulary unreachable (q = 0 outside one of 4 groups): still lossless
    "coral-router-dynamic-tree": lambda t: seeded(CoralRouterDrafter, t, module={"groups": 4, "active": 1},
                                                  tree={"kind": "dynamic", "depth": 3, "topk": 2, "total_tokens": 6}),
    # a pruned draft vocabulary (module.draft_vocab): q = 0 outside the 3 most frequent ids, still lossless
    "eagle2-draft-vocab": lambda t: seeded(EagleDrafter, t, module={"draft_vocab": 3, "vocab_counts": str(counts(t))},
                                           tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8}),
    "medusa-static-tree": lambda t: seeded(MedusaDrafter, t, module={"num_heads": 2},
                                           tree=[[0], [1], [0, 0], [0, 1], [1, 0]]),
    "sd-sampling": lambda t: IndependentDrafter(t, gamma=3, module={"init_layers": [0, 1, 2]}),
    "sd-dynamic-tree": lambda t: IndependentDrafter(t, module={"init_layers": [0, 1, 2]},
                                                    tree={"kind": "dynamic", "depth": 3, "topk": 3, "total_tokens": 8}),
    "pld-deterministic": lambda t: PromptLookup(num_pred_tokens=4, max_ngram=2),
    # the drafters with a design of their own (cross-attention over the target's cache, the target's low/mid/high
    # features): Hydra-composed as tests/test_conformance.py builds them, their dynamic trees cut to 8 tokens
    "beagle-config": lambda t: config_drafter("beagle", t),
    "eagle3-config": lambda t: config_drafter("eagle3", t),
    "moa-config": lambda t: config_drafter("moa", t),
    "tree-iid-siblings": lambda t: RandomTreeDrafter(V, seed=5, sampling=True, max_depth=3, width=3),
    "tree-deterministic": lambda t: RandomTreeDrafter(V, seed=6, sampling=False, max_depth=3, width=3),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


T1 = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
CASES = [(name, T1) for name in sorted(DRAFTERS)] + [("sd-sampling", WARPED), ("tree-iid-siblings", WARPED)]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-T{p.temperature:g}-k{p.top_k}" for n, p in CASES])
def test_sd_samples_follow_the_target_law(name, params):
    t = target()
    law = exact_law(t, params)
    drafter = DRAFTERS[name](t)
    small, big = samples(t, drafter, params, 120, seed=1), samples(t, drafter, params, 1000, seed=2)
    assert chi2_pvalue(big, law, 1000) > 1e-3
    assert tv(big, law, 1000) < tv(small, law, 120)


def test_the_chi_square_test_rejects_the_draft_models_law():
    """Negative control: sampling from the draft model alone (no verification) is detected."""
    t = target()
    params = SamplingParams(temperature=1.0)
    law = exact_law(t, params)
    draft_only = TargetModel(IndependentDrafter(t, gamma=1, module={"init_layers": [0, 1, 2]}).model, None, t.device, "draft")
    counts = samples(draft_only, IndependentDrafter(t, gamma=1, module={"init_layers": [0]}), params, 1000, seed=3)
    assert chi2_pvalue(counts, law, 1000) < 1e-3
