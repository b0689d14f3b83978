"""A preallocated KV cache (issue 30): a transformers `Cache` whose layers write keys and values in place into buffers
sized once, instead of DynamicCache's torch.cat of the whole cache at every forward (a copy of every layer's keys and
values per step).

- `update` writes the new rows at the current length (a slice assignment) and returns views of the buffers up to the
  new length: attention reads exactly what DynamicCache's would, so outputs are the same (tested token for token);
- `crop` is a length change, compaction (specbench/decode/target.py compact_cache) an in-place copy of the accepted entries
  through the same views;
- a buffer grows (doubling, one copy) only when a forward would run past it: sized to the run's context, it never does.

Rows of a batch share one length unless told otherwise: `set_row_lengths` makes them ragged (batched decoding, issue
29), each row then writing at its own length into the same buffers, the views reaching the longest row (a row's
entries past its own length are stale, hidden by the engine's per-row mask). No transformers code is forked or patched: the model calls `update`,
`get_seq_length` and `get_mask_sizes` as it does on any Cache.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specbench.decode.rows import RowCounts
from specbench.errors import SpecbenchError


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's K / V buffers [B, kv_heads, capacity, head_dim] and the length in use (per row, when the
    rows are ragged)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int):
        self.capacity = max(int(capacity), 1)
        self.length = 0  # the longest row's
        # per-row lengths when ragged (the host's ints, and on the device where each row writes), else None
        self.rows: RowCounts | None = None
        self._k: torch.Tensor | None = None  # [B, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None
        super().__init__()  # (assigns keys / values = None: the setters below accept that)

    @property
    def live_rows(self) -> int | None:
        """The batch rows in use, the first ones (None: every row of the buffers)."""
        return None

    def _hold(self, rows: int) -> None:
        """From now on the first `rows` batch rows are in use: here, every row of the buffers."""
        if self._k is not None and rows != self._k.shape[0]:
            raise ValueError(f"{rows} row lengths for a batch of {self._k.shape[0]}")

    # keys / values: views of the rows in use (what DynamicCache's layer holds), writable in place
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[: self.live_rows, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a preallocated layer's keys are written in place (update / its views), not assigned")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[: self.live_rows, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a preallocated layer's values are written in place (update / its views), not assigned")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        # zeros, not new_empty: ragged rows attend (masked) over columns another row wrote and this one never did, and
        # uninitialised memory may hold a NaN that a mask's large negative cannot hide (NaN + x = NaN)
        self._k = key_states.new_zeros(b, h, self.capacity, dk)
        self._v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        """Past the buffers: reallocate at twice the need and copy the rows in use (never within a sized run)."""
        self.capacity = 2 * need
        k, v = self._k, self._v
        self._k = k.new_zeros(*k.shape[:2], self.capacity, k.shape[-1])
        self._v = v.new_zeros(*v.shape[:2], self.capacity, v.shape[-1])
        self._k[:, :, : self.length] = k[:, :, : self.length]
        self._v[:, :, : self.length] = v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the Q new rows [B, kv_heads, Q, head_dim] at the current length; return K, V up to the new length."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            self._grow(end)
        if self.rows is None:
            self._k[:, :, self.length : end] = key_states
            self._v[:, :, self.length : end] = value_states
        else:  # ragged: each row behind its own entries, every row in one scatter
            cols = self.rows.dev[:, None] + torch.arange(q, device=self.rows.dev.device)  # [B, Q]
            rows = torch.arange(cols.shape[0], device=cols.device)[:, None]  # [B, 1]
            # advanced indices around a slice put their axes first: the target is [B, Q, kv_heads, head_dim]
            self._k[rows, :, cols] = key_states.transpose(1, 2)
            self._v[rows, :, cols] = value_states.transpose(1, 2)
            self.rows = self.rows + q
            end = self.rows.max()
        self.length = end
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """update without its return: for a drafter that reads its keys elsewhere (MoA's CA and TLI copies)."""
        self.update(key_states, value_states)

    def set_row_lengths(self, lengths: RowCounts | Sequence[int]) -> None:
        """Row b holds lengths[b] entries from now on (after a per-row compaction); equal lengths end raggedness.
        RowCounts bring their device copy (the engine's, a drafter's); plain ints are copied to the device."""
        self._hold(len(lengths))
        self.length = max(lengths, default=0)
        if len(set(lengths)) <= 1:
            self.rows = None
        elif isinstance(lengths, RowCounts) and lengths.dev is not None:
            self.rows = lengths
        else:
            self.rows = RowCounts.copy(lengths, self._k.device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset), as DynamicLayer: the rows in use + the query

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows past its capacity if it must (a model must not cut its context to it)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: minus the number of entries to drop."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of entries to drop")
        if self.rows is not None:
            self.set_row_lengths((self.rows + tokens_to_remove).clamp(min=0))
        else:
            self.length = max(self.length + tokens_to_remove, 0)

    def reset(self) -> None:
        self.length, self.rows = 0, None

    def move_entries(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every batch row b, the entries at columns src[b] [M] copied to columns dst[b] [M] (one gather and one
        scatter for the whole batch; the gather is taken before anything is written)."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        self._k[rows, :, dst] = self._k[rows, :, src]
        self._v[rows, :, dst] = self._v[rows, :, src]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, keep: int) -> None:
        """Batch rows src [M] copied into rows dst [M], then only the first `keep` rows stay (a view: the buffers are
        not copied). How a finished row leaves: the last live row moves into its place."""
        if self._k is None:
            return
        if src.numel():
            self._k[dst] = self._k[src]
            self._v[dst] = self._v[src]
        self._k, self._v = self._k[:keep], self._v[:keep]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._k is not None:
            self._k = self._k.index_select(0, beam_idx.to(self._k.device))
            self._v = self._v.index_select(0, beam_idx.to(self._v.device))


class PreallocatedCache(Cache):
    """One PreallocatedLayer per decoder layer of `config`, each `capacity` positions (the run's context: prompt, new
    tokens and the largest tree). Full-attention decoders only (Llama, Vicuna, SmolLM2, Qwen2 without sliding
    windows): a config with other layer types is refused in one line."""

    def __init__(self, config, capacity: int):
        text = config.get_text_config(decoder=True)
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window",
                                                                                             True):
            window = " with a sliding window" if kinds == {"full_attention"} else ""
            raise SpecbenchError(f"the preallocated KV cache every decode runs on holds full-attention layers only; "
                                 f"{text.model_type} has {', '.join(sorted(kinds))}{window}")
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(text.num_hidden_layers)])

    def set_row_lengths(self, lengths: RowCounts | Sequence[int]) -> None:
        """Ragged rows (batched decoding): row b holds lengths[b] entries in every layer (one device copy for every
        layer)."""
        if not isinstance(lengths, RowCounts) and len(set(lengths)) > 1 and self.layers[0]._k is not None:
            lengths = RowCounts.copy(lengths, self.layers[0]._k.device)
        for layer in self.layers:
            layer.set_row_lengths(lengths)

    def row_lengths(self) -> list[int]:
        """Entries per row (host ints)."""
        layer = self.layers[0]
        b = 0 if layer._k is None else layer._k.shape[0]
        return list(layer.rows) if layer.rows is not None else [layer.length] * b

    def leave(self, src: torch.Tensor, dst: torch.Tensor, keep: int, lengths: RowCounts | Sequence[int]) -> None:
        """A batch shrinks to its first `keep` rows, rows src [M] moved into rows dst [M] first (a finished row's place
        taken by a later row: specbench/decode/rows.py), holding `lengths` entries each: the moved rows are copied,
        the others stay where they are (no copy of the buffers)."""
        for layer in self.layers:
            layer.move_rows(src, dst, keep)
        self.set_row_lengths(lengths)


@dataclass
class StaticWindow:
    """What every layer of one static cache shares for the forward at hand (set by StaticCache.begin or place)."""

    width: int  # the columns attention reads (a context block)
    live: int  # the batch rows that hold a prompt (the first `live`; the others pad the batch bucket)


class StaticLayer(PreallocatedLayer):
    """model.compile: one layer's buffers at a fixed capacity and a fixed batch (the batch bucket), which attention
    reads whole (static shapes for torch.compile and CUDA graphs; the engine's mask hides the columns not in use). A
    forward writes batch row b's rows at the device-side offset `at[b]` (set by StaticCache.begin or place before
    each forward, shared by every layer), so a compiled graph never reads the host's lengths; the host lengths (what
    `keys` / `values` view, crop and compaction use) are advanced by StaticCache.advance after the forward, for the
    rows that count (a padded tree's padding rows are written past them, stale). Ragged rows (a batch) are PreallocatedLayer's:
    per-row host lengths and their device copy. The batch rows past `live` pad the bucket: written, never read."""

    def __init__(self, capacity: int, at: torch.Tensor, window: StaticWindow):
        super().__init__(capacity)
        self.write_at = at  # [batch bucket] long, on the device
        self.window = window

    @property
    def live_rows(self) -> int:
        return self.window.live  # (the buffers hold the whole bucket)

    def _hold(self, rows: int) -> None:
        if self._k is not None and rows > self._k.shape[0]:
            raise ValueError(f"{rows} row lengths for a static cache of {self._k.shape[0]} rows")
        self.window.live = rows

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # buffers that live as long as the graphs: CUDA graphs may capture writes into them (mode reduce-overhead)
        torch._dynamo.mark_static_address(self._k)
        torch._dynamo.mark_static_address(self._v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [bucket, kv_heads, Q, head_dim]: batch row b's Q rows written at columns at[b] .. at[b] + Q - 1
        (one scatter for the batch); returns the buffers up to the window's width."""
        self.write(key_states, value_states)
        return self.window_kv()

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """update without its return, so a compiled region that only writes does not depend on the window's width
        (one graph for every context block: Beagle's and MoA's appends)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cols = self.write_at[:, None] + torch.arange(key_states.shape[-2], device=key_states.device)  # [bucket, Q]
        rows = torch.arange(cols.shape[0], device=cols.device)[:, None]
        # (advanced indices around a slice put their axes first: the target is [bucket, Q, kv_heads, head_dim])
        self._k[rows, :, cols] = key_states.transpose(1, 2)
        self._v[rows, :, cols] = value_states.transpose(1, 2)

    def window_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [bucket, kv_heads, width, head_dim]: the buffers up to the window's width, what `update` returns,
        without a write (a cross-attention's keys: Beagle's and MoA's CA, read before or apart from their writes)."""
        w = self.window.width
        return self._k[:, :, :w], self._v[:, :, :w]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window.width, 0

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, keep: int) -> None:
        """As PreallocatedLayer's, but the buffers keep their bucket of rows (the graphs hold them): the rows past
        `keep` are padding from now on."""
        if self._k is not None and src.numel():
            self._k[dst] = self._k[src]
            self._v[dst] = self._v[src]
        self.window.live = keep


class StaticCache(PreallocatedCache):
    """model.compile's cache: StaticLayer buffers of `capacity` positions and `batch` rows (a batch bucket) for every
    decoder layer of `config`, kept by the compiled decoder that runs on it (`runner`, specbench/decode/compiled.py:
    the target's or a drafter's) and reused across generations (its graphs hold on to them). A batch of fewer rows
    than the bucket runs in its first rows, the rest padding; rows are ragged as PreallocatedCache's."""

    def __init__(self, config, capacity: int, device: torch.device, runner=None, batch: int = 1):
        PreallocatedCache(config, 1)  # the same refusal of sliding-window layers
        text = config.get_text_config(decoder=True)
        self.at = torch.zeros(batch, dtype=torch.long, device=device)  # [batch] where each row writes
        # (a drafter's compiled region sets it in its graph, compile_region: a CUDA graph may write it in place)
        torch._dynamo.mark_static_address(self.at)
        self.capacity, self.batch = capacity, batch
        self.window = StaticWindow(width=capacity, live=batch)
        self.runner = runner  # the CompiledDecoder whose graphs are built on these buffers
        Cache.__init__(self, layers=[StaticLayer(capacity, self.at, self.window) for _ in range(text.num_hidden_layers)])

    @property
    def live(self) -> int:
        """The batch rows in use (the first ones)."""
        return self.window.live

    def row_lengths(self) -> list[int]:
        layer = self.layers[0]
        return list(layer.rows) if layer.rows is not None else [layer.length] * self.live

    def begin(self, rows: int, block: int | None = None, live: int | None = None) -> int:
        """Where the next forward writes its `rows` rows: every live row behind its own entries (the padding rows of
        the bucket at 0, in their own unused rows); past the capacity is refused (the engine sizes the capacity to the
        run: prompt, new tokens and the largest padded tree). Attention reads the entries up to the end of their
        `block`-sized context block (all of the capacity without one): one graph per block, not per length. `live`:
        the rows of a forward on an empty cache (a prefill; later forwards keep the cache's). Returns that width."""
        if live is not None:
            if live > self.batch:
                raise SpecbenchError(f"model.compile: {live} rows on a static cache of {self.batch}")
            self.window.live = live
        first = self.layers[0]
        return self.place(first.length if first.rows is None else first.rows, rows, block)

    def place(self, at: RowCounts | int, rows: int, block: int | None = None) -> int:
        """begin's placement given by the caller: live row b writes at at[b] (an int: every row there), the padding
        rows at 0; the longest live row's entries are the width's base. For a drafter whose layers hold different
        counts (MoA: its SA and TLI layers), where the first layer's lengths do not say. Returns the width."""
        longest = at if isinstance(at, int) else at.max()
        if longest + rows > self.capacity:
            raise SpecbenchError(f"model.compile: {longest + rows} positions exceed the static cache's {self.capacity}")
        if isinstance(at, int):
            self.at.fill_(at)
        else:
            self.at[: self.live].copy_(at.dev)
        self.at[self.live :] = 0
        end = longest + rows
        self.window.width = self.capacity if block is None else min(self.capacity, block * -(-end // block))
        return self.window.width

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's whole K, V buffers [bucket, kv_heads, capacity, head_dim]: shapes that never change (a
        drafter's compiled region reading the target's cache: MoA's)."""
        return [(layer._k, layer._v) for layer in self.layers]

    def advance(self, rows: int) -> None:
        """The forward's first `rows` rows now count as cached, in every live row."""
        first = self.layers[0]
        if first.rows is None:
            for layer in self.layers:
                layer.length += rows
            return
        lengths = first.rows + rows
        for layer in self.layers:
            layer.rows, layer.length = lengths, lengths.max()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.window.live = self.batch
