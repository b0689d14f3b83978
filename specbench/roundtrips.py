"""Host round trips: count the operations that make the host wait for the device (or copy to it), from outside.

On a GPU every one of these stalls the launch queue until the device catches up (or issues a blocking copy), so a
decoding step pays a full queue drain per round trip; on a CPU they cost Python time only. Counting them per step is
how the hot path is kept lean (tests/test_roundtrips.py bounds them per drafter; `make perf-drafters` reports them).

Counted, through a TorchFunctionMode (nothing in the project is patched):
- device -> host reads: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")` (a device tensor, or the CPU
  named), and `bool()` / `int()` /
  `float()` / `__index__` of a tensor (an `if` on a tensor, a tensor used as a Python index);
- indexing (or assigning) with a 0-dim integer tensor: ATen reads it as a Python scalar (`.item()` inside, invisible
  to a count of `.item()` calls);
- ops whose output shape depends on the data, which the host must read before it can go on: `nonzero`, `unique`,
  `masked_select`, indexing with a boolean tensor, single-argument `torch.where`, `repeat_interleave` with tensor
  repeats and no `output_size`;
- host -> device copies: `torch.tensor(...)` / `torch.as_tensor(...)` built from (non-empty) Python data.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
DATA_DEPENDENT = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}
FROM_PYTHON = {"tensor", "as_tensor"}


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _kind(name: str, args: tuple, kwargs: dict) -> str | None:
    if name in READS or name in DATA_DEPENDENT:
        return name
    if name in FROM_PYTHON:
        data = args[0] if args else kwargs.get("data")
        empty = isinstance(data, (list, tuple)) and len(data) == 0  # nothing to copy (transformers' lazy cache init)
        return None if isinstance(data, torch.Tensor) or empty else name
    if name == "to":
        # a read when a device tensor goes to the CPU, or when the code names the CPU (a string) as a GPU run would
        # see it; `.to(x.device)` with x on the CPU is the same device here and on a GPU (transformers' rotary does it)
        dest = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        src = args[0].device if args and isinstance(args[0], torch.Tensor) else None
        if _is_cpu(dest) and (isinstance(dest, str) or (src is not None and src.type != "cpu")):
            return "to(cpu)"
        return None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
            return "bool-index"
        # a 0-dim integer tensor as an index is a Python scalar to ATen: it calls .item() on it (a device read on a
        # GPU) before it can index; gather / index_select take it on the device
        if any(isinstance(i, torch.Tensor) and i.dim() == 0 and not i.is_floating_point() for i in parts):
            return "scalar-index"
        return None
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(cond)"
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave"
    return None


class HostRoundTrips(TorchFunctionMode):
    """`with HostRoundTrips() as rt: ...` then `rt.total` and `rt.counts` (by operation)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(getattr(func, "__name__", ""), args, kwargs)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
