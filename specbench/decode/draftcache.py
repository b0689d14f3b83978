"""A drafter's own cache over the rows of a batch (issue 77): one kind for every batch size, 1 included, and the one
place that keeps its row bookkeeping, so that no drafter keeps lengths, rolls back drafted entries or follows a
leaving row by hand.

A drafter with its own keys and values (EAGLE's head, sd's draft model, EAGLE-3's mid-layer, Beagle's cross-attention
keys, MoA's caches) holds a `DraftCache`. Each batch row holds its `verified` entries (those of verified tokens, which
stay) and, while a tree grows, drafted entries behind them (which go). A step is always:

    pos, mask = dc.extend(fresh, n, dtype)   # geometry for each row's fresh[b] new verified entries (n wide, padded)
    out = forward(..., dc.cache, position_ids=pos, attention_mask=mask)
    dc.commit(fresh)                          # they count now; a row's padding entries past them are stale
    tree = dc.grow(grow, root, region, policy, vocab)  # the tree's levels, drafted entries dropped after

(`dc.append(step, fresh, *inputs, region=...)` in place of the first three for layers that are not an HF decoder;
`fresh, ids = dc.unseen(state)` for a drafter that re-reads the verified tokens, sd's and MoA's), and `dc.keep(leave)`
when finished rows leave the batch (CachedRows.keep_rows). The cache is a PreallocatedCache written at each row's own
length, or model.compile's StaticCache: at batch 1 the rows are one, the cache unragged (a slice write), and a new
row's entries are causal among themselves, so no mask is built for them (the model's causal one): an optimisation
inside the one path, not a second path.

`CompiledTree` runs `grow` under model.compile as one compiled region: the same `grow` function the eager path calls,
with `laid_out=True` (its forwards inside the region, specbench/decode/compiled.py `decode`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from specbench.decode.compiled import STATIC_BLOCK, Region, compile_region, pad_rows, step_rows
from specbench.decode.drafter import RowsDrafter
from specbench.decode.kvcache import PreallocatedCache, StaticCache
from specbench.decode.rows import RowCounts
from specbench.decode.tree import batch_tree_mask
from specbench.decode.types import DraftTree, TargetState

if TYPE_CHECKING:
    from specbench.decode.rows import Leave


class GrownTree(Protocol):
    """What a tree policy returns (drafters/trees.py Grown)."""

    tokens: torch.Tensor  # [A, N]
    parents: torch.Tensor  # [A, N]
    is_chain: bool
    priority: torch.Tensor | None  # [A, N]

    def draft(self) -> DraftTree: ...


# at(seen [A, m, S] bool, depth, dtype) -> (positions [A, m], additive mask [A, 1, m, width]): a tree level's forward
# geometry in the drafter's cache (its m nodes' entries written behind the S - m drafted before them)
At = Callable[[torch.Tensor, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
# grow(root [A, ...], at, laid_out) -> the policy's trees: the drafter's levels, each one forward at `at`'s geometry
# (laid_out: inside CompiledTree's region, `decode(..., laid_out=True)`). Tensor ops only (no host read).
Grow = Callable[[torch.Tensor, At, bool], GrownTree]


class DraftCache:
    """A drafter's cache (`cache`, what its forwards take) and each row's verified entries in it (`verified`)."""

    def __init__(self, cache: PreallocatedCache, rows: int, device: torch.device | str):
        self.cache = cache
        self.verified = RowCounts.zeros(rows, device)  # [A] entries of verified tokens, per row

    @classmethod
    def for_decoder(cls, target, config, state: TargetState, decoder: torch.nn.Module | None = None) -> "DraftCache":
        """For a drafter's HF decoder of `config` (EAGLE's head, sd's draft model): a preallocated cache of the state's
        rows, sized to its positions; model.compile with `decoder` named: that compiled decoder's static cache
        (TargetModel.drafter_cache)."""
        cache = target.drafter_cache(config, state.cache_positions, decoder, rows=state.rows)
        return cls(cache, state.rows, state.tokens.device)

    @property
    def static(self) -> bool:
        """model.compile's static cache (its forwards compiled; a tree can grow in one region)."""
        return isinstance(self.cache, StaticCache)

    @property
    def rows(self) -> int:
        return len(self.verified)

    def unseen(self, state: TargetState, behind: int = 0) -> tuple[RowCounts, torch.Tensor]:
        """The catch-up of a drafter that re-reads verified tokens (sd's draft model, MoA's layers): row b's tokens
        verified[b] .. lengths[b] - behind - 1, those it has no entries of yet (behind: the last ones it keeps out,
        MoA's root) -> their counts [A] and the tokens [A, n] left-aligned (past a row's count: padding)."""
        fresh = state.lengths - behind - self.verified
        cols = self.verified.dev[:, None] + torch.arange(fresh.max(), device=state.tokens.device)  # [A, n]
        return fresh, state.tokens.gather(1, cols.clamp(max=state.num_tokens - 1))

    def rollback(self) -> None:
        """Every row back to its verified entries: what was drafted behind them is dropped (stale)."""
        self.cache.set_row_lengths(self.verified)

    def extend(self, fresh: RowCounts, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The geometry of a forward writing row b's fresh[b] new verified entries, left-aligned in n >= fresh.max()
        columns (past fresh[b]: padding): positions verified[b] + j [A, n] and the additive mask [A, 1, n, width]
        (each sees its row's verified entries and the new ones up to itself), None for one row (the model's causal
        mask says the same). Drafted entries are dropped first."""
        self.rollback()
        v = self.verified.dev
        pos = v[:, None] + torch.arange(n, device=v.device)
        if self.rows == 1:
            return pos, None
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril().expand(self.rows, n, n)
        return pos, batch_tree_mask(causal, v, self.verified.max() + n, dtype)

    def causal(self, prefixes: torch.Tensor, q: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The geometry `append`'s step writes q new entries at, behind each row's prefixes [P] verified ones: positions
        [P, q] and the additive causal mask [P, 1, q, width] (each sees its row's verified entries and the new ones up
        to itself), width the static window's (model.compile) or the longest row's entries plus q."""
        causal = torch.ones(q, q, dtype=torch.bool, device=prefixes.device).tril().expand(prefixes.shape[0], q, q)
        width = self.cache.window.width if self.static else self.verified.max() + q
        return prefixes[:, None] + torch.arange(q, device=prefixes.device), batch_tree_mask(causal, prefixes, width,
                                                                                             dtype)

    def append(self, step: Callable[..., torch.Tensor], fresh: RowCounts, *inputs: torch.Tensor,
               region: Region | None = None, whole: tuple = ()) -> torch.Tensor:
        """Row b's fresh[b] new verified entries through `step(prefixes [P], *inputs)`, for a drafter whose layers are
        not an HF decoder (EAGLE-3's mid-layer, Beagle's keys, MoA's layers): inputs [A, n, ...] left-aligned (past
        fresh[b]: padding), written behind each row's verified entries at the geometry `causal(prefixes, q, dtype)`
        gives, the step's output [A, n, ...] returned (None from a step that only writes: Beagle's); then they count
        (commit). Under model.compile with `region` (a Region of the same step, held by the drafter): the inputs padded
        to the static cache's batch bucket and to a row bucket (the prompt's entries: as they are, eagerly), the write
        offsets placed, the step one compiled graph; the one code either way. whole: more arguments, passed to the step
        as they are after the inputs (under model.compile: shapes that never change, MoA's target K/V buffers whole)."""
        self.rollback()
        a, n = inputs[0].shape[:2]
        if region is None or not self.static:
            out = step(self.verified.dev, *inputs, *whole)
        else:
            prefill = self.cache.get_seq_length() == 0
            q, bucket = step_rows(n, prefill), self.cache.batch
            self.cache.begin(q, STATIC_BLOCK)  # each row's entries behind its own verified ones
            out = region(self.cache, prefill, pad_rows(self.verified.dev, bucket),
                         *(pad_rows(x, bucket, q) for x in inputs), *whole)
            out = None if out is None else out[:a, :n]
        self.commit(fresh)
        return out

    def commit(self, fresh: RowCounts) -> None:
        """The entries extend() laid out count now: row b holds fresh[b] more (its padding past them: stale)."""
        self.verified = self.verified + fresh
        self.rollback()

    def set_verified(self, counts: RowCounts) -> None:
        """Row b holds counts[b] verified entries from now on (sd's chain keeps the accepted ones of its drafts)."""
        self.verified = counts
        self.rollback()

    def at(self, seen: torch.Tensor, depth: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree level's geometry outside a compiled region (At): its nodes at depth `depth` below the root, which
        sits at position verified[b] - 1, each seeing its row's verified entries and its drafted ancestors' and
        own slots among the S written so far (every row writes behind its own length)."""
        v = self.verified.dev
        return ((v + depth - 1)[:, None].expand(seen.shape[0], seen.shape[1]),
                batch_tree_mask(seen, v, self.verified.max() + seen.shape[-1], dtype))

    def grow(self, grow: Grow, root: torch.Tensor, region: "CompiledTree | None", policy, vocab: int,
             entries: int | None = None) -> DraftTree:
        """The step's trees grown from root [A, ...] (the root's feature, token or logits) -> DraftTree [A, N]. On the
        static cache with a `region` (a drafter whose levels have no host read): one compiled region; else `grow`'s
        levels one forward each. Either way the drafted entries are dropped after. entries: the drafted entries the
        tree appends to the cache (default policy.expanded(vocab))."""
        if region is not None and self.static:
            return region.grow(self.cache, policy, vocab, grow, root, self.verified.dev, entries)
        grown = grow(root, self.at, False)
        self.rollback()
        return grown.draft()

    def keep(self, leave: "Leave") -> None:
        """Finished rows left the batch: the rows kept, in their new order (specbench/decode/rows.py)."""
        self.verified = self.verified.keep(leave)
        self.cache.leave(leave.src, leave.dst, len(leave.index), self.verified)


class CachedRows(RowsDrafter):
    """The rows protocol (specbench/decode/drafter.py RowsDrafter) of a drafter whose own keys and values are a
    DraftCache, `cache` (made by its prefill_rows): a row leaving the batch leaves the cache, its one holder of rows."""

    cache: DraftCache | None = None

    def keep_rows(self, leave: "Leave") -> None:
        self.cache.keep(leave)


class CompiledTree:
    """model.compile (issue 48, item 4): a drafter's whole tree (every level's forward on its static cache and the
    policy's top-k, scores and gathers) as one compiled region, so the levels replay without Python in between. The
    region spans the cache's batch bucket (padding rows grow a tree of their own, never read); each level writes its
    nodes' entries behind the row's verified ones (`cache.at`, set in the graph) and the decoder runs laid out
    (specbench/decode/compiled.py, `decode(..., laid_out=True)`); the host lengths never advance, so the drafted
    entries are dropped when it returns. One graph per (batch bucket, context block, policy). Held by the drafter
    (its graphs outlive a generation's DraftCache)."""

    def __init__(self):
        self._region = None

    def grow(self, cache: StaticCache, policy, vocab: int, grow: Grow, root: torch.Tensor,
             prefixes: torch.Tensor, entries: int | None = None) -> DraftTree:
        """root [A, ...], prefixes [A] (each row's verified entries in the cache) -> the step's DraftTree [A, N]."""
        a = root.shape[0]
        policy.prepare(root.device)  # (a policy's constant tensors made outside the graph, not as its outputs)
        # the width every level's mask spans
        cache.begin(policy.expanded(vocab) if entries is None else entries, STATIC_BLOCK)
        if self._region is None:
            self._region = compile_region(self._grow, cache)
        # the rows past `a` padding
        tokens, parents, priority, chain = self._region(grow, cache, pad_rows(root, cache.batch),
                                                        pad_rows(prefixes, cache.batch))
        # copies: a CUDA graph's outputs are its own buffers, rewritten by its next replay
        return DraftTree(tokens=tokens[:a].clone(), parents=parents[:a].clone(), is_chain=chain,
                         priority=None if priority is None else priority[:a].clone())

    @staticmethod
    def _grow(grow: Grow, cache: StaticCache, root: torch.Tensor, prefixes: torch.Tensor):
        """What is compiled: root [P, ...], prefixes [P] -> tokens, parents, priority [P, N], is_chain."""
        p = root.shape[0]

        def at(seen: torch.Tensor, depth: int, dtype: torch.dtype):
            m, s = seen.shape[1], seen.shape[2]
            cache.at.copy_(prefixes + (s - m))  # this level's rows behind the levels before
            return ((prefixes + depth - 1)[:, None].expand(p, m),
                    batch_tree_mask(seen, prefixes, cache.window.width, dtype))

        grown = grow(root, at, True)
        return grown.tokens, grown.parents, grown.priority, grown.is_chain
