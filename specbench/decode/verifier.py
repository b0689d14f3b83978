"""The target's half of the decode loop behind one small interface, so that the engine (specbench/decode/engine.py)
drives the same loop whether the target runs in this process (`LocalVerifier`) or in a server process across a
connection (specbench/deploy/client.py's RemoteVerifier, issue 78).

The engine keeps the drafter, the rows' bookkeeping (Rows: verified tokens, prefixes, budgets), the counters and the
clock; the verifier does everything the target does:
    prefill(prompts, budgets, capacity, gens) the prompts through the target, each row's first token
    verify(tree, rows, limits)                geometry, the target forward, acceptance, `decide`; the step's new tokens
                                              written into rows.ids (on the device: the drafter stages its lookahead
                                              from them before the read)
    finish(step, staged)                      the step's one host read, the cache compaction, and the rows the
                                              drafter reads next (hidden / layers)
    leave(step, rows)                         finished rows leave its cache
    kv()                                      the target's K/V as the drafter reads them (TargetState.kv, kv_static)
LocalVerifier is the code the engine ran inline before (same ops, same order: same numerics, same one host read a
step).

`Crossing` is how a drafter declares what crosses a client-server split (Drafter.crossing, specbench/deploy): it lives
here because drafters import only the decoding core.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from specbench.decode.kvcache import StaticCache
from specbench.decode.drafter import HIDDEN, KV, LAYERS
from specbench.decode.outcome import StepOutcome, StepRead, decide
from specbench.decode.rows import RowCounts, Rows
from specbench.decode.sampling import logits_to_probs, sample
from specbench.decode.target import TargetModel, cache_kv, compact_rows
from specbench.decode.tree import ancestor_matrices, batch_tree_mask
from specbench.decode.types import DraftTree, SamplingParams, TargetState
from specbench.decode.verify import Acceptance, greedy_accept_rows, rejection_accept_rows

if TYPE_CHECKING:
    from specbench.decode.rows import Leave


@dataclass
class Prefilled:
    """The prompts after the target's prefill."""

    ids: torch.Tensor  # [A, L] the prompts, right-padded
    first: torch.Tensor  # [A] each row's first new token, on the device
    logits: torch.Tensor | None  # [A, V] the rows that chose them (None where they did not cross: a split)
    hidden: torch.Tensor | None  # [A, L, H'] the rows the drafter reads (the prompt's), None: it reads none
    layers: torch.Tensor | None  # [A, L, k*H] EAGLE-3's features, None: not needed


@dataclass
class Verified:
    """One step on the device, before its host read."""

    tree: DraftTree
    acc: Acceptance  # each row's accepted path, length, next token
    out: StepOutcome  # each row's emitted tokens, stop and counters' numbers (outcome.py)
    logits: torch.Tensor | None  # [A, Q, V] the tree forward's (capture_at), None where they did not cross
    hidden: torch.Tensor | None  # [A, Q, H'] the forward's rows (gathered to the accepted ones in finish)
    layers: torch.Tensor | None  # [A, Q, k*H]


@dataclass
class Finished:
    """One step after its host read: what the engine counts and what the drafter reads next."""

    read: StepRead
    accepted: RowCounts  # each row's accepted nodes
    hidden: torch.Tensor | None  # [A, max A_r + 1, H'] the rows of every root and accepted path
    layers: torch.Tensor | None


@dataclass(frozen=True)
class Crossing:
    """What a drafter needs of the target per verified token when the target is across a connection
    (specbench/deploy): `specs` (name, width) in the order the server's answer carries them (8-bit, per row); the
    server computes them with `server(state)` from the TargetState it would hand the drafter locally (the fresh
    rows' hidden states and the target's K/V) -> one [n, width] tensor per spec for the n fresh rows of row 0; the
    client hands them to the drafter as TargetState.hidden, [1, n, sum of widths] (the specs side by side), after
    `client()` switched the drafter to read them there. A drafter that declares none cannot run split."""

    specs: tuple[tuple[str, int], ...] = ()
    server: Callable[[TargetState], list[torch.Tensor]] | None = None
    client: Callable[[], None] | None = None


class LocalVerifier:
    """The target in this process: the engine's loop as it always ran."""

    def __init__(self, target: TargetModel, sampling: SamplingParams, needs: frozenset[str],
                 layers: tuple[int, ...] = ()):
        """needs: what the drafter reads (Drafter.needs); layers: the hidden_states indices it reads (LAYERS)."""
        self.target, self.sampling, self.needs, self.layer_ids = target, sampling, needs, layers
        self.eos = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long, device=target.device)  # [E]
        self.cache = None

    def prefill(self, prompts: list[list[int]], budgets: list[int], capacity: int,
                generators: list[torch.Generator | None]) -> Prefilled:
        """A cache of `capacity` positions per row, the prompts through the target, each row's first token (budgets:
        each row's new tokens, which a remote target is told; the cache's capacity bounds them here). Ragged
        prompts are right-padded under the causal mask (a real token never sees the padding after it), each row's
        first token read at its own last position."""
        target, dev = self.target, self.target.device
        # ragged rows need buffers written in place: the preallocated cache (model.compile: the static cache of a
        # batch bucket)
        self.cache = cache = target.new_cache(capacity, batch=len(prompts), ragged=True)
        lens = [len(p) for p in prompts]
        width = max(lens)
        ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=dev)  # [A, L]
        fwd = target.forward(ids, cache, logits_rows=slice(0, 0), layers=self.layer_ids)
        last = torch.tensor([n - 1 for n in lens], device=dev)
        logits = target.lm_head(fwd.hidden[torch.arange(len(prompts), device=dev), last]).float()  # [A, V]
        cache.set_row_lengths(lens)
        if self.sampling.greedy:
            first = logits.argmax(-1)
        else:
            first = torch.cat([sample(logits_to_probs(logits[r], self.sampling), g)[None]
                               for r, g in enumerate(generators)])
        return Prefilled(ids, first, logits, fwd.hidden if HIDDEN in self.needs else None, fwd.layers)

    def geometry(self, tree: DraftTree, rows: Rows):
        """The step's forward inputs for every live row: ids [A, Q] (root, then the nodes), positions [A, Q], the
        additive mask [A, 1, Q, W] (None for a lone row's chain: the model's causal mask says the same, and the cache
        of one row is not ragged) and the ancestor matrices [A, Q, Q]."""
        anc = ancestor_matrices(tree.parents)  # [A, Q, Q]
        depth = anc.sum(-1)  # [A, Q] ancestors counting itself: the root 1, its children 2, ...
        roots = rows.ids.gather(1, rows.prefix.dev[:, None])  # [A, 1] the last verified token, at index prefix
        ids = torch.cat([roots, tree.tokens], 1)
        q = anc.shape[-1]
        lone_chain = len(rows) == 1 and tree.is_chain
        mask = None if lone_chain else batch_tree_mask(anc, rows.prefix.dev, rows.prefix.max() + q, self.target.dtype)
        return ids, rows.prefix.dev[:, None] - 1 + depth, mask, anc, depth

    def verify(self, tree: DraftTree, rows: Rows, limits: RowCounts) -> Verified:
        """One target forward over every live row's [root, nodes], acceptance and the outcome, on the device; every
        row's new tokens (accepted + next) written behind its root in rows.ids (past a row's end: stale)."""
        dev = self.target.device
        x_ids, pos, mask, anc, depth = self.geometry(tree, rows)
        fwd = self.target.forward(x_ids, self.cache, position_ids=pos, attention_mask=mask, layers=self.layer_ids)
        logits = fwd.logits  # [A, Q, V]
        if self.sampling.greedy:
            acc = greedy_accept_rows(tree.tokens, tree.parents, anc, logits.argmax(-1), tree.valid)
        else:
            acc = rejection_accept_rows(tree.tokens, tree.parents, anc, logits_to_probs(logits, self.sampling),
                                        tree.draft_probs, [row.generator for row in rows.live], tree.row_sizes(),
                                        tree.valid)
        n = tree.tokens.shape[1]
        # each row's emitted tokens, its stop and its counters' numbers, on the device (outcome.py)
        out = decide(acc, tree.tokens, tree.parents, depth, tree.valid, limits.dev - rows.prefix.dev - 1, self.eos)
        rows.ids.scatter_(1, rows.prefix.dev[:, None] + 1 + torch.arange(n + 1, device=dev), out.new)
        return Verified(tree, acc, out, logits, fwd.hidden, fwd.layers)

    def finish(self, step: Verified, rows: Rows, staged: torch.Tensor | None) -> Finished:
        """The step's one host transfer (the outcome and the drafter's staged counts), the cache compacted to the
        accepted paths, and the hidden rows of every root and accepted path, [A, max A_r + 1, H]."""
        read = step.out.read(staged)
        acc, a = step.acc, step.tree.tokens.shape[0]
        accepted = RowCounts(tuple(st.accepted for st in read.rows), acc.length)  # each row's accepted nodes
        compact_rows(self.cache, rows.prefix + 1, acc.path, accepted, read.contiguous)
        keep = torch.cat([acc.path.new_zeros(a, 1), acc.path[:, : accepted.max()] + 1], 1).clamp(min=0)
        hid = None
        if HIDDEN in self.needs:
            hid = step.hidden.gather(1, keep[:, :, None].expand(-1, -1, step.hidden.shape[-1]))
        lay = None if step.layers is None else step.layers.gather(1, keep[:, :, None].expand(-1, -1,
                                                                                            step.layers.shape[-1]))
        return Finished(read, accepted, hid, lay)

    def leave(self, step: "Leave", rows: Rows) -> None:
        """Finished rows leave the cache as they left `rows` (rows.leave already applied)."""
        self.cache.leave(step.src, step.dst, len(rows), rows.prefix)

    #: the target answers (a split's RemoteVerifier: False once its link dropped, and the drafter finishes alone)
    online = True

    def end(self, gens: list) -> None:
        """The generation is over (its clock stopped): nothing to collect in this process."""
        del gens

    def kv(self) -> tuple[list | None, list | None]:
        """(TargetState.kv, TargetState.kv_static) for a drafter that reads the target's K/V, else (None, None)."""
        if KV not in self.needs:
            return None, None
        return (cache_kv(self.cache, self.target.device),
                self.cache.buffers() if isinstance(self.cache, StaticCache) else None)


def layer_ids(drafter) -> tuple[int, ...]:
    """The target layers' inputs a drafter reads (EAGLE-3's features), () for the others."""
    return tuple(drafter.hidden_layers) if LAYERS in drafter.needs else ()
