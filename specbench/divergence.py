"""A greedy output that leaves the baseline's: a numerical near-tie or a real mismatch?

In bf16 (or fp16) a tree verification and one-token decoding round differently, so where the target's two best tokens
are almost level a lossless drafter can emit the other one and the text diverges from there with no bug anywhere.
At the first divergence of a turn the target is run once more over the prompt and the common prefix; the top-2 logit
margin at that position says which it was:

- near-tie: the two runs' tokens are the target's two best there, and their margin is within NEAR_TIE_ULPS units in
  the last place of the top logit in the target's dtype (a few roundings of a long reduction);
- mismatch: anything else (a token outside the top two, or a clear margin): a bug until shown otherwise.

The lossless count itself stays strict (token for token); fp32 is the strict check CI runs, where a near-tie needs
margins of ~1e-5 logits.
"""
from __future__ import annotations

import torch

NEAR_TIE_ULPS = 8


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length if one is a prefix of the other), or
    None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(target, prompt_ids: list[int], common: list[int], ours: int, theirs: int) -> dict:
    """prompt + the tokens both runs emitted before the divergence -> {margin, top2, tolerance, kind}."""
    ids = torch.tensor([prompt_ids + common], device=target.device)
    logits = target.forward(ids, target.new_cache(), logits_rows=slice(-1, None)).logits[0, -1]  # [V]
    top = logits.topk(2)
    (l1, l2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    tol = NEAR_TIE_ULPS * abs(l1) * torch.finfo(target.dtype).eps
    kind = "near_tie" if {ours, theirs} == {t1, t2} and l1 - l2 <= tol else "mismatch"
    return {"margin": l1 - l2, "top2": [t1, t2], "tolerance": tol, "kind": kind}
