"""The rows of a batch while they decode: one structure for each prompt's bookkeeping, one place that reorders them.

Row r of every batched tensor of a step (the target cache, the verified tokens, the lengths, the drafter's own rows)
belongs to `Rows.live[r]`. A finished row leaves by index: the last live row takes its place (one row copied, the
others stay where they are), and every holder of rows applies the same `Leave`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from specbench.decode.verify import rows_at

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


@dataclass(frozen=True)
class Leave:
    """How a batch shrinks: new row r is old row index[r]; rows src [M] move into rows dst [M] (on the device)."""

    index: list[int]
    index_t: torch.Tensor  # [A'] the same on the device
    src: torch.Tensor  # [M]
    dst: torch.Tensor  # [M]


@dataclass(frozen=True)
class RowCounts:
    """A count per live row (a cache's entries, a row's verified tokens, its fresh hidden rows), held where each of its
    two readers needs it: `host` sizes a step in Python (a forward's width, a mask's columns, a row's slice) and `dev`
    feeds the step's tensor ops (positions, write offsets, gathers) without a host read. Both change together, here:
    a count is never advanced on one side by hand."""

    host: tuple[int, ...]
    dev: torch.Tensor  # [A] int64, the same counts on the device

    @classmethod
    def zeros(cls, rows: int, device: torch.device | str | None) -> "RowCounts":
        return cls((0,) * rows, torch.zeros(rows, dtype=torch.long, device=device))

    @classmethod
    def copy(cls, host: Sequence[int], device: torch.device | str | None) -> "RowCounts":
        """Host ints, copied to the device: one transfer for rows of different counts, none for equal ones (a fill:
        on CUDA a copy from pageable memory would wait for the stream)."""
        host = tuple(int(n) for n in host)
        if len(set(host)) <= 1:
            return cls(host, torch.full((len(host),), host[0] if host else 0, dtype=torch.long, device=device))
        return cls(host, torch.tensor(host, dtype=torch.long, device=device))

    def __len__(self) -> int:
        return len(self.host)

    def __iter__(self) -> Iterator[int]:
        return iter(self.host)

    def __getitem__(self, r: int) -> int:
        return self.host[r]

    def max(self) -> int:
        return max(self.host, default=0)

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """x [A, n, ...] -> each row's entry at its own count - 1, [A, ...] (a row's last fresh hidden state or output,
        its last verified token), on the device."""
        return rows_at(x, self.dev - 1)

    @property
    def ragged(self) -> bool:
        """Rows of different counts."""
        return len(set(self.host)) > 1

    def __add__(self, other: "RowCounts | int") -> "RowCounts":
        if isinstance(other, int):
            return RowCounts(tuple(a + other for a in self.host), self.dev + other)
        return RowCounts(_zip(self.host, other.host, int.__add__), self.dev + other.dev)

    def __sub__(self, other: "RowCounts | int") -> "RowCounts":
        if isinstance(other, int):
            return RowCounts(tuple(a - other for a in self.host), self.dev - other)
        return RowCounts(_zip(self.host, other.host, int.__sub__), self.dev - other.dev)

    def clamp(self, min: int | None = None, max: int | None = None) -> "RowCounts":
        lo, hi = -(1 << 62) if min is None else min, (1 << 62) if max is None else max
        host = tuple(sorted((lo, n, hi))[1] for n in self.host)
        return RowCounts(host, self.dev.clamp(min=min, max=max))

    def keep(self, leave: "Leave") -> "RowCounts":
        """The counts of the rows a leave keeps, in their new order."""
        return RowCounts(tuple(self.host[i] for i in leave.index), self.dev.index_select(0, leave.index_t))


def _zip(a: tuple[int, ...], b: tuple[int, ...], op) -> tuple[int, ...]:
    if len(a) != len(b):
        raise ValueError(f"RowCounts of {len(a)} and {len(b)} rows")
    return tuple(op(x, y) for x, y in zip(a, b))


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
    `prefix[r] + 1`) and `prefix`: the entries each holds in the target cache, its verified tokens but the last (the
    root)."""

    def __init__(self, live: list[Row], ids: torch.Tensor, prefix: RowCounts):
        self.live, self.ids, self.prefix = live, ids, prefix

    def __len__(self) -> int:
        return len(self.live)

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
        self.prefix = self.prefix.keep(step)
        return step
