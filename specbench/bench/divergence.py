"""A greedy output that leaves the baseline's: a numerical near-tie or a real mismatch?

In bf16 (or fp16) a tree verification and one-token decoding round differently, so where the target's two best tokens
are almost level a lossless drafter can emit the other one and the text diverges from there with no bug anywhere.
At the first divergence of a T=0 turn (position j) the diverging step is replayed on both paths, each as its own run
computed it:

- the baseline's path: one-token decoding (the engine with no drafter) over the prompt, up to token j;
- the drafter's path: the drafter's own engine over the prompt, up to token j; the logits row captured is the tree
  row that chose token j (the row of the node below which it was accepted, or drawn as the bonus).

A turn decoded in a batch (decoding.batch_size > 1) is replayed as each run decoded it: that run's whole batch (its
rows and budgets), capturing the diverging row (classify_batch).

It is a **near-tie** only when each path reproduces its own run's token (the baseline's row argmax is the baseline's
token, the tree row's argmax is the drafter's) and the swing between the paths is rounding-sized: how far the
baseline's row puts its token above the drafter's, plus how far the tree row puts the drafter's above the baseline's,
at most NEAR_TIE_ULPS units in the last place of the top logit in the target's dtype. The same function, computed two
ways, put a different one of nearly level tokens first (in bf16 three can be level: each row's runner-up need not be
the other run's token). Anything else is a **mismatch**, a bug until shown otherwise: a path that does not reproduce its
run (a verification that emits the runner-up of its own row is caught here, however small the margin: its tree row
replays to the other token), or two paths that disagree by more than rounding (a tree row computing another function).
The old rule (one fresh forward, a margin of 8·|l1|·eps(dtype): a 3-7x probability ratio in bf16, and no replay)
filed such a swap as a near-tie.

The lossless count itself stays strict (token for token); fp32 is the strict check CI runs.
"""
from __future__ import annotations

import torch

NEAR_TIE_ULPS = 4


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length if one is a prefix of the other), or
    None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _path(logits: torch.Tensor, own: int, other: int) -> dict:
    """The token this row gives as the engine picks it (argmax: the lowest id among exactly equal logits, which fp16
    produces; topk orders such ties arbitrarily), its top two and their margin."""
    logits = logits.float()
    token = int(logits.argmax())
    second = int(logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == token, float("-inf"))
                 .argmax())
    return {"token": token, "top2": [token, second], "margin": float(logits[token] - logits[second]),
            "top_logit": float(logits[token]), "reproduces": token == own,
            "own_minus_other": float(logits[own] - logits[other])}


def classify(baseline_engine, drafter_engine, prompt_ids: list[int], position: int, ours: int, theirs: int,
             context: int | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """Replay token `position` of a T=0 turn on the baseline's path (it emitted `theirs`) and on the drafter's (it
    emitted `ours`) -> {kind, swing, tolerance, baseline: {...}, drafter: {...}} with each path's token, top-2 and
    margin; dtype: the target's (its rounding sets the tolerance)."""
    rows = {}
    for name, engine in (("baseline", baseline_engine), ("drafter", drafter_engine)):
        gen = engine.generate(prompt_ids, position + 1, None, context, capture_at=position)
        rows[name] = gen.captured
    return judge(rows["baseline"], rows["drafter"], ours, theirs, dtype, position)


def classify_batch(baseline_engine, baseline_batch: tuple[list, list, int], drafter_engine,
                   drafter_batch: tuple[list, list, int], position: int, ours: int, theirs: int,
                   context: int | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """As classify, for a turn decoded in a batch (decoding.batch_size > 1): a batched forward may round otherwise
    than a lone one, so each path replays its own batch (baseline_batch / drafter_batch: (prompts, budgets, row), the
    rows that run decoded together with their budgets, so that the same rows share every forward and leave at the
    same steps, and the diverging turn's row among them) and captures that row's logits at `position`."""
    rows = {}
    for name, engine, (prompts, budgets, row) in (("baseline", baseline_engine, baseline_batch),
                                                  ("drafter", drafter_engine, drafter_batch)):
        out = engine.generate_batch(prompts, budgets, None, context, capture_at={row: position})
        rows[name] = out.rows[row].captured
    return {**judge(rows["baseline"], rows["drafter"], ours, theirs, dtype, position),
            "replayed": f"batches of {len(baseline_batch[0])} (baseline) and {len(drafter_batch[0])} (drafter)"}


def judge(baseline_row: torch.Tensor | None, drafter_row: torch.Tensor | None, ours: int, theirs: int,
          dtype: torch.dtype, position: int) -> dict:
    """The rule above, on the logits row each path chose its token at ([V] each); a replay that stopped before
    `position` (None: an EOS earlier than its run's) does not reproduce its run: a mismatch."""
    short = [name for name, row in (("baseline", baseline_row), ("drafter", drafter_row)) if row is None]
    if short:
        return {"kind": "mismatch", "why": f"the {' and '.join(short)} replay stopped before token {position}"}
    base = _path(baseline_row, theirs, ours)
    draft = _path(drafter_row, ours, theirs)
    swing = base["own_minus_other"] + draft["own_minus_other"]  # >= 0 when both reproduce
    tol = NEAR_TIE_ULPS * max(abs(base["top_logit"]), abs(draft["top_logit"])) * torch.finfo(dtype).eps
    tie = base["reproduces"] and draft["reproduces"] and swing <= tol
    return {"kind": "near_tie" if tie else "mismatch", "swing": swing, "tolerance": tol, "baseline": base,
            "drafter": draft}


def classify_by_forward(target, prompt_ids: list[int], common: list[int], ours: int, theirs: int) -> dict:
    """One-sided, for a path that cannot be replayed here (the authors' code in `make peer`): the target's logits after
    prompt + the tokens both outputs share, from one fresh forward over the whole sequence -> a near-tie when that row
    gives one of the two tokens and puts it at most NEAR_TIE_ULPS ulps of its top logit above the other, else a
    mismatch. Weaker than classify (one path, and not as either run computed it)."""
    ids = torch.tensor([prompt_ids + common], device=target.device)
    logits = target.forward(ids, target.new_cache(ids.shape[1]), logits_rows=slice(-1, None)).logits[0, -1]  # [V]
    row = _path(logits, ours, theirs)
    other = theirs if row["token"] == ours else ours
    gap = float(logits.float()[row["token"]] - logits.float()[other])
    tol = NEAR_TIE_ULPS * abs(row["top_logit"]) * torch.finfo(target.dtype).eps
    tie = row["token"] in (ours, theirs) and gap <= tol
    return {"kind": "near_tie" if tie else "mismatch", "replayed": "one forward (one-sided)", "gap": gap,
            "tolerance": tol, "target": row}
