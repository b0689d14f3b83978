"""Host round trips: count the operations that make the host wait for the device (or copy to it), from outside.

On a GPU every one of these stalls the launch queue until the device catches up (or issues a blocking copy), so a
decoding step pays a full queue drain per round trip; on a CPU they cost Python time only. Counting them per step is
how the hot path is kept lean (tests/test_roundtrips.py bounds them per drafter; `make perf-drafters` reports them).

Counted, through a TorchFunctionMode (nothing in the project is patched):
- device -> host reads: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")` (a device tensor, or the CPU
  named), and `bool()` / `int()` /
  `float()` / `__index__` of a tensor (an `if` on a tensor, a tensor used as a Python index);
- a 0-dim tensor where ATen wants a number, which it reads with an `.item()` of its own (a sync on a GPU, invisible
  to a count of `.item()` calls): indexing (or assigning) with a 0-dim integer
  tensor, anywhere in the index, a slice bound or a list element included ("scalar-index"); an argument whose every
  ATen overload takes a number there (`full`'s fill value, `arange`'s bounds, `topk`'s k, `select`'s index, a size
  given to `view` / `expand`, `add`'s alpha, ...), and the ops whose Tensor overload reads it all the same (`narrow`'s
  start, `masked_fill`'s and `index_fill`'s value) ("scalar-arg"). Where an op's Tensor overload takes it on the
  device (`torch.where`, `clamp`, `x * t`) nothing is counted;
- ops whose output shape depends on the data, which the host must read before it can go on: `nonzero`, `unique`,
  `masked_select`, indexing with a boolean tensor, single-argument `torch.where`, `repeat_interleave` with tensor
  repeats and no `output_size`;
- host -> device copies: `torch.tensor(...)` / `torch.as_tensor(...)` built from (non-empty) Python data.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
DATA_DEPENDENT = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}
FROM_PYTHON = {"tensor", "as_tensor"}
# ops whose Tensor overload reads the argument at this position with .item() all the same (ATen's narrow.Tensor,
# masked_fill.Tensor, index_fill.int_Tensor)
READS_TENSOR_ARG = {"narrow": 2, "masked_fill": 2, "masked_fill_": 2, "index_fill": 3, "index_fill_": 3}
_NUMBERS = {"int", "SymInt", "float", "number", "bool", "complex"}


def _is_scalar_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _number_type(t: str) -> bool:
    """An ATen argument type a tensor can only be read into (int, SymInt[], Scalar?, ...)."""
    for wrap in ("Optional[", "List["):
        if t.startswith(wrap):
            t = t[len(wrap):-1]
    return t in _NUMBERS


@lru_cache(maxsize=None)
def _schemas(name: str) -> tuple[tuple[list[str], dict[str, str]], ...]:
    """`aten::name`'s overloads: (positional argument types, every argument's type by name); none for a Python
    function of another name."""
    out = []
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        out.append(([str(a.type) for a in schema.arguments if not a.kwarg_only],
                    {a.name: str(a.type) for a in schema.arguments}))
    return tuple(out)


def _number_at(name: str, key: int | str) -> bool:
    """Every overload of `aten::name` that has argument `key` (a position or a name) reads a number there (a position
    past the positional ones goes into a trailing list: `view(2, 3)`)."""
    kinds = []
    for positional, named in _schemas(name):
        if isinstance(key, str):
            t = named.get(key)
        elif key < len(positional):
            t = positional[key]
        else:
            t = positional[-1] if positional and positional[-1].startswith("List[") else None
        if t is not None:
            kinds.append(_number_type(t))
    return bool(kinds) and all(kinds)


def _reads_scalar_arg(name: str, args: tuple, kwargs: dict) -> bool:
    """A 0-dim tensor (or a list holding one) passed where ATen reads a number."""
    def holds(x) -> bool:
        return _is_scalar_tensor(x) or (isinstance(x, (list, tuple)) and any(_is_scalar_tensor(y) for y in x))

    keys = [k for k, a in enumerate(args) if holds(a)] + [n for n, a in kwargs.items() if holds(a)]
    if not keys:
        return False
    if READS_TENSOR_ARG.get(name) in keys:
        return True
    return any(_number_at(name, k) for k in keys)


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
        # a 0-dim integer tensor as an index (alone, a slice bound, in a list) is a Python scalar to ATen: it calls
        # .item() on it (a device read on a GPU) before it can index; gather / index_select take it on the device
        scalars = [i for i in parts if _is_scalar_tensor(i)]
        for i in parts:
            if isinstance(i, slice):
                scalars += [b for b in (i.start, i.stop, i.step) if _is_scalar_tensor(b)]
            elif isinstance(i, list):
                scalars += [b for b in i if _is_scalar_tensor(b)]
        if any(not i.is_floating_point() for i in scalars):
            return "scalar-index"
        return None
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(cond)"
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave"
    if not name.startswith("__") and _reads_scalar_arg(name, args, kwargs):
        return "scalar-arg"
    return None


_OPEN: list["HostRoundTrips"] = []  # the counters whose `with` block is running (a sync is counted by each)


def count_sync(kind: str = "synchronize") -> None:
    """A wait no torch function shows (torch.cuda.synchronize, an event's wait): the caller reports it here
    (specbench/decode/clock.py sync), and every open counter counts it, whatever the device."""
    for counter in _OPEN:
        counter.counts[kind] += 1


class HostRoundTrips(TorchFunctionMode):
    """`with HostRoundTrips() as rt: ...` then `rt.total` and `rt.counts` (by operation). Also counted: the device
    synchronisations the project's code reports (count_sync), as "synchronize"."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __enter__(self):
        _OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _OPEN.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(getattr(func, "__name__", ""), args, kwargs)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
