"""The rows of a batch while they decode: one structure for each prompt's bookkeeping, one place that reorders them.

Row r of every batched tensor of a step (the target cache, the verified tokens, the lengths, the drafter's own rows)
belongs to `Rows.live[r]`. A finished row leaves by index: the last live row takes its place (one row copied, the
others stay where they are), and every holder of rows applies the same `Leave`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specbench.decode.engine import Generation


@dataclass
class Row:
    """One prompt of a batch while it decodes."""

    index: int  # its place among the caller's prompts
    gen: "Generation"  # its tokens and counters
    budget: int  # max new tokens
    generator: torch.Generator | None  # its RNG (T > 0)
    capture_at: int | None  # the new token whose choosing logits it keeps (divergence replays), None: none
    prefix: int  # entries it holds in the target cache: its verified tokens but the last (the root)


@dataclass(frozen=True)
class Leave:
    """How a batch shrinks: new row r is old row index[r]; rows src [M] move into rows dst [M] (on the device)."""

    index: list[int]
    index_t: torch.Tensor  # [A'] the same on the device
    src: torch.Tensor  # [M]
    dst: torch.Tensor  # [M]


def swap_remove(n: int, done: set[int]) -> list[int]:
    """index[new] = old for the n - len(done) rows not done: a finished row's place below the new size is taken by a
    live row above it, every other live row keeps its place."""
    keep = n - len(done)
    index = list(range(keep))
    holes = [r for r in range(keep) if r in done]
    movers = [r for r in range(keep, n) if r not in done]
    for hole, mover in zip(holes, movers):
        index[hole] = mover
    return index


class Rows:
    """The live rows in cache-row order, their verified tokens on the device (`ids` [A, capacity], row r's first
    `prefix + 1`) and their cache lengths there (`lengths` [A], the device's copy of each Row.prefix)."""

    def __init__(self, live: list[Row], ids: torch.Tensor, lengths: torch.Tensor):
        self.live, self.ids, self.lengths = live, ids, lengths

    def __len__(self) -> int:
        return len(self.live)

    @property
    def prefixes(self) -> list[int]:
        return [r.prefix for r in self.live]

    def leave(self, done: set[int]) -> Leave:
        """Drop the rows `done` (their places) from the batch; returns the Leave every other holder applies."""
        index = swap_remove(len(self.live), done)
        moves = [(old, new) for new, old in enumerate(index) if old != new]
        # one host -> device copy for the step: the index and the moves. On CUDA from pinned memory, asynchronous: a
        # blocking copy from pageable memory would wait for the stream (a stall of the device queue per leave)
        flat = torch.tensor(index + [m[0] for m in moves] + [m[1] for m in moves], dtype=torch.long)
        dev = self.ids.device
        flat = flat.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else flat.to(dev)
        k, m = len(index), len(moves)
        step = Leave(index, flat[:k], flat[k : k + m], flat[k + m :])
        self.live = [self.live[i] for i in index]
        self.ids = self.ids.index_select(0, step.index_t)  # a few ints a row: a fresh buffer (old views stay whole)
        self.lengths = self.lengths.index_select(0, step.index_t)
        return step
