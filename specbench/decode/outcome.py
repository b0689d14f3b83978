"""A step's outcome as the host needs it: decided on the device for every row at once, read in one transfer.

After acceptance (verify.py) each row emits its accepted tokens and the bonus/recovered one, cut after the first EOS
or at its token budget. Where it stops, and the few per-row numbers its counters need (specbench/decode/engine.py's
Generation), are computed here with tensor ops, so that the step's one host read carries the emitted tokens and
these numbers, not the trees:

    A·(N+1) + 6·A + 1 ints per step   (+ A when the drafter stages its next draft lengths: pld)

for A live rows and trees padded to N nodes: every row's N+1 new tokens (padded), its six numbers (`RowStep`), and
one flag for the cache compaction. A traced run (Engine(trace=True)) reads the trees besides, in a second transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.decode.verify import Acceptance

_GO, _BUDGET, _EOS = 0, 1, 2  # a row's stop, as the device writes it
_STOPS = {_GO: None, _BUDGET: "max_new_tokens", _EOS: "eos"}
_PER_ROW = 6  # RowStep's numbers, in the order `decide` stacks them


@dataclass(frozen=True)
class RowStep:
    """One row's step, on the host."""

    emitted: list[int]  # the tokens it appends: accepted + next, cut after an EOS or at its budget
    accepted: int  # accepted drafted nodes (A_r)
    # a child of the last accepted node (or of the root) was drafted and rejected (verify.py's recovered): so the walk
    # tried one depth more than it accepted (the per-depth counters)
    recovered: bool
    chain: bool  # its real nodes are a chain (parents -1, 0, 1, ...; no node is one too)
    deepest: int  # the depth of its tree's deepest real node (children of the root: 1; no node: 0)
    stop: str | None  # None: it decodes on; "eos" or "max_new_tokens" (Generation.stopped_by)


@dataclass(frozen=True)
class StepRead:
    """The step's one host read."""

    rows: list[RowStep]
    contiguous: bool  # every row's accepted path is its nodes 0..A_r-1 (the cache compaction copies nothing)
    staged: list[int]  # the drafter's Lookahead counts, one per row ([] when it staged nothing)


@dataclass(frozen=True)
class StepOutcome:
    """The same on the device, before the read."""

    new: torch.Tensor  # [A, N+1] every row's accepted tokens then its next one (past A_r + 1: stale)
    stats: torch.Tensor  # [A, 6] per row: emitted, accepted, recovered, chain, deepest, stop
    contiguous: torch.Tensor  # [1]

    def read(self, staged: torch.Tensor | None = None) -> StepRead:
        """The one host transfer: these and the drafter's staged counts [A] (None: none)."""
        a, w = self.new.shape
        parts = [self.new.flatten(), self.stats.flatten(), self.contiguous]
        flat = torch.cat(parts if staged is None else [*parts, staged]).tolist()
        at = a * w
        rows = []
        for r in range(a):
            count, accepted, recovered, chain, deepest, stop = flat[at + _PER_ROW * r : at + _PER_ROW * (r + 1)]
            rows.append(RowStep(flat[r * w : r * w + count], accepted, bool(recovered), bool(chain), deepest,
                                _STOPS[stop]))
        at += _PER_ROW * a
        return StepRead(rows, bool(flat[at]), flat[at + 1 :])


def decide(acc: Acceptance, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
           valid: torch.Tensor | None, left: torch.Tensor, eos: torch.Tensor) -> StepOutcome:
    """tokens, parents [A, N] the verified trees; depth [A, N+1] each tree row's ancestors counting itself (the root
    1: ancestor_matrices(parents).sum(-1)); valid [A, N] (None: no padding); left [A] the tokens each row may still
    emit (>= 1); eos [E] the EOS ids. Everything stays on the device."""
    a, n = tokens.shape
    dev = tokens.device
    emit = acc.length + 1
    new = torch.cat([tokens.gather(1, acc.path.clamp(min=0)), acc.next_token.new_zeros(a, 1)], 1)
    new.scatter_(1, acc.length[:, None], acc.next_token[:, None])  # [A, N+1]
    pos = torch.arange(n + 1, device=dev)
    hit = torch.isin(new, eos) & (pos < emit[:, None])
    first = torch.where(hit, pos, n + 1).amin(-1)  # [A] the first emitted EOS (n + 1: none)
    # as emitting one token at a time would: an EOS stops the row where it is emitted, even on its budget's last token
    eos_stop = (first <= n) & (first < left)
    count = torch.minimum(torch.minimum(emit, first + 1), left)
    stop = torch.where(eos_stop, _EOS, torch.where(left <= emit, _BUDGET, _GO))
    if n == 0:
        chain, deepest = torch.ones_like(emit), torch.zeros_like(emit)
        contiguous = torch.ones(1, dtype=torch.long, device=dev)
    else:
        idx = torch.arange(n, device=dev)
        links, nodes = parents == idx - 1, depth[:, 1:] - 1
        if valid is not None:
            links, nodes = links | ~valid, torch.where(valid, nodes, 0)
        chain, deepest = links.all(-1).long(), nodes.amax(-1)
        contiguous = ((acc.path == idx) | (acc.path < 0)).all().long().view(1)
    stats = torch.stack([count, acc.length, acc.recovered.long(), chain, deepest, stop], 1)
    return StepOutcome(new, stats, contiguous)
