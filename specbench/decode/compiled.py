"""model.compile (issue 30): one HF decoder's tree forwards through torch.compile, over a static cache.

The target's decoder and the drafters' own decoders (EAGLE's one-layer head for eagle / eagle2 / hass / coral, sd's
draft model) are compiled the same way, gpt-fast's: static shapes, so that a graph is captured once and replayed.

- the cache is a `StaticCache` (specbench/decode/kvcache.py): fixed buffers, each batch row written at its own
  device-side offset, the host lengths advanced outside the graph;
- a batch is padded to the cache's batch bucket (BATCH_BUCKETS): the rows past it hold token 0 at position 0 and see
  their own first entry only (their cache rows are never read); ragged rows come with the caller's per-row mask;
- a forward of Q <= max(BUCKETS) rows (a tree level, a verified tree, a chain) is padded to the next bucket; padding
  rows hold token 0 (or a zero embedding) at the first row's position, see the first cached entry only, and are
  written past the length that counts (stale);
- attention reads the cache up to the end of the current STATIC_BLOCK-sized context block: one graph per (bucket,
  block), not per length; the mask (causal when None) is widened to the block, its unused columns hidden;
- a prefill (an empty cache) runs eagerly on the same buffers: prompts have any length.
On CUDA with inductor, mode reduce-overhead captures each graph as a CUDA graph.
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from specbench.errors import SpecbenchError
from specbench.decode.kvcache import StaticCache
from specbench.decode.tree import tree_attention_mask

log = logging.getLogger("specbench")

# tree forwards padded to these row counts (one graph each). Above 16 in steps of half the previous power of two, not
# powers of two only: on a compute-bound device a padding row costs as much as a real one, and Medusa's 20-row tree
# padded to 32 made its compiled verification slower than the eager one (two_baselines at d1b6ae1: 125 vs 108 ms)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# batch rows, the same way (a batch past the last is its own bucket)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
STATIC_BLOCK = 256  # static caches, and the context attention reads, in blocks of this many positions


def torch_compile(fn, device: torch.device, backend: bool | str):
    """torch.compile with static shapes: backend True = inductor (with CUDA graphs on CUDA), a string or a callable
    another torch.compile backend (tests: aot_eager, the same capture and guards without a C++ build)."""
    import torch._dynamo

    # one graph per (tree bucket, context block) and per kind of compiled decoder (the target's, a drafter's), all of
    # them entries of CompiledDecoder._step's one code object: far more than dynamo's default of 8 (past the limit it
    # would fall back to eager, silently)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    name = "inductor" if backend is True else backend
    cuda_graphs = name == "inductor" and device.type == "cuda"
    return torch.compile(fn, dynamic=False, backend=name, mode="reduce-overhead" if cuda_graphs else None)


def compile_option(compile: bool | str) -> bool | str:
    """model.compile as TargetModel's `compile`: False, True (inductor) or another torch.compile backend's name; an
    unknown name refused in one line (before anything loads)."""
    if compile is False or compile is None:
        return False
    if compile is True or compile == "inductor":
        return True
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(compile, str) or compile not in known:
        raise SpecbenchError(f"model.compile={compile}: true, false or a torch.compile backend ({', '.join(sorted(known))})")
    return compile


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's counter): a run counts those built in its
    timed turns."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class CompiledDecoder:
    """One decoder (an HF base model: layers and final norm, no LM head) compiled for tree forwards on its static
    caches. `new_cache` hands out the cache the graphs are built on: two at most, one row's and a batch bucket's (a
    batched run's last group may hold one prompt), each reused across generations, replaced by a larger one only when
    a generation needs more (its graphs are then built anew)."""

    def __init__(self, decoder: nn.Module, config, device: torch.device, backend: bool | str):
        self._decoder = weakref.ref(decoder)  # (weak: CompiledDecoders keys on the decoder, and a value must not keep it)
        self.config, self.device, self.backend = config, device, backend
        self.step = torch_compile(self._step, device, backend)
        self._caches: dict[bool, StaticCache] = {}  # bucket 1 (a batch of one) or a larger one -> its cache
        self._last: StaticCache | None = None  # the one handed out last
        self.warned = False  # a forward of more rows than the largest bucket was logged

    @property
    def capacity(self) -> int:
        """Positions the static cache handed out last holds (0 before the first)."""
        return 0 if self._last is None else self._last.capacity

    @property
    def decoder(self) -> nn.Module:
        return self._decoder()

    def new_cache(self, capacity: int | None = None, batch: int = 1) -> StaticCache:
        """A cleared static cache for `capacity` positions (rounded up to STATIC_BLOCK, room for a padded tree) and
        `batch` rows (rounded up to a batch bucket). A batch runs on the held batch cache if its bucket is as large (a
        batch that shrinks as its rows finish, a run's last batch of fewer prompts: the same graphs, the missing rows
        padding); batch 1 on a cache of its own, kept beside it."""
        need = (capacity or 1024) + max(BUCKETS)
        rows = next((k for k in BATCH_BUCKETS if k >= batch), batch)
        one_row = rows == 1
        held = self._caches.get(one_row)
        if held is None or held.capacity < need or held.batch < rows:
            self._caches.pop(one_row, None)  # (the old buffers go before the new ones are allocated)
            self._last = None
            held = self._caches[one_row] = StaticCache(self.config, STATIC_BLOCK * -(-need // STATIC_BLOCK), self.device,
                                                    runner=self, batch=rows)
        held.reset()
        self._last = held
        return held

    def _step(self, ids: torch.Tensor | None, embeds: torch.Tensor | None, pos: torch.Tensor, mask: torch.Tensor,
              cache: StaticCache, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What is compiled: static shapes (ids [B, Q] or embeds [B, Q, H] with Q a bucket, mask [B, 1, Q, width]),
        the cache written at its device-side offset, nothing read on the host."""
        out = self.decoder(input_ids=ids, inputs_embeds=embeds, past_key_values=cache, position_ids=pos,
                           attention_mask=mask, use_cache=True, output_hidden_states=bool(layers))
        picked = torch.cat([out.hidden_states[i] for i in layers], -1) if layers else None
        return out.last_hidden_state, picked

    def laid_out(self, cache: StaticCache, position_ids: torch.Tensor,  # [bucket, Q]
                 attention_mask: torch.Tensor,  # [bucket, 1, Q, width] additive
                 input_ids: torch.Tensor | None = None,  # [bucket, Q]
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:  # [bucket, Q, H]
        """The decoder's forward inside a caller's compiled region (compile_region): the inputs already span the cache's
        whole batch bucket, the mask the width `cache.begin` set, each row writes at `cache.at` as the region set it,
        and the host lengths are not advanced (the region's entries are drafted ones, dropped after it). -> [bucket,
        Q, H]"""
        return self._step(input_ids, inputs_embeds, position_ids, attention_mask, cache, ())[0]

    def forward(self, cache: StaticCache, input_ids: torch.Tensor | None = None,  # [A, Q]
                inputs_embeds: torch.Tensor | None = None,  # [A, Q, H]
                position_ids: torch.Tensor | None = None,  # [A, Q]
                attention_mask: torch.Tensor | None = None,  # [A, 1, Q, cached+Q] additive, or None = causal
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (last hidden state [A, Q, H], the `layers`' hidden states concatenated [A, Q, k*H] or None). A rows
        (the cache's live rows; a prefill sets them), padded to the cache's batch bucket; `cached` is the longest
        row's entries (ragged rows: the caller's mask says which columns each row sees)."""
        if cache.runner is not self:
            raise SpecbenchError("model.compile: a static cache runs on the decoder whose graphs were built on it")
        x = input_ids if input_ids is not None else inputs_embeds
        b, q = x.shape[:2]
        dtype = next(self.decoder.parameters()).dtype
        n = cache.get_seq_length()
        if n > 0 and b != cache.live:
            raise SpecbenchError(f"model.compile: a forward of {b} rows on a static cache holding {cache.live}")
        if position_ids is None:
            position_ids = torch.arange(n, n + q, device=x.device)[None].expand(b, -1)
        if attention_mask is None:  # causal: the prefix and the rows up to itself (a chain's tree mask)
            chain = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
            attention_mask = tree_attention_mask(chain, n, dtype)
        pad = next((k for k in BUCKETS if k >= q), None) if n > 0 else None  # a prefill (n = 0) is not compiled
        if pad is None and n > 0 and not self.warned:  # a tree past the largest bucket: said, not hidden
            self.warned = True
            log.warning("model.compile: a forward of %d rows (more than %d) runs eagerly", q, max(BUCKETS))
        rows, bucket = (q if pad is None else pad), cache.batch
        width = cache.begin(rows, STATIC_BLOCK, live=b if n == 0 else None)
        mask = attention_mask.new_full((bucket, 1, rows, width), torch.finfo(attention_mask.dtype).min)
        mask[:b, :, :q, : n + q] = attention_mask
        # inputs copied into fresh [bucket, rows] tensors: a graph guards on strides, and a caller's slice of its
        # tokens has the strides of the whole sequence
        xs, pos = x.new_zeros(bucket, rows, *x.shape[2:]), position_ids.new_zeros(bucket, rows)
        xs[:b, :q], pos[:b, :q] = x, position_ids
        if rows > q:  # padding rows of a tree: at the first row's position, seeing the first cached entry only
            mask[:b, :, q:, 0] = 0.0
            pos[:b, q:] = position_ids[:, :1]
        mask[b:, :, :, 0] = 0.0  # padding rows of the batch bucket: the same, in their own cache rows
        ids, embeds = (xs, None) if input_ids is not None else (None, xs)
        step = self._step if pad is None else self.step
        hidden, picked = step(ids, embeds, pos, mask, cache, tuple(layers))
        cache.advance(q)
        return hidden[:b, :q], None if picked is None else picked[:b, :q]


class CompiledDecoders:
    """model.compile's compiled drafter decoders, one per decoder module (weakly keyed: a drafter gone, its static
    cache goes; dynamo keeps its graphs, keyed by shapes, for the next drafter of the same shapes). Owned by the
    TargetModel, which hands their caches out (drafter_cache)."""

    def __init__(self, device: torch.device, backend: bool | str):
        self.device, self.backend = device, backend
        self._by_module: weakref.WeakKeyDictionary[nn.Module, CompiledDecoder] = weakref.WeakKeyDictionary()

    def cache(self, decoder: nn.Module, config, capacity: int, batch: int = 1) -> StaticCache:
        runner = self._by_module.get(decoder)
        if runner is None:
            runner = self._by_module[decoder] = CompiledDecoder(decoder, config, self.device, self.backend)
        return runner.new_cache(capacity, batch)


def pad_rows(x: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
    """x [A, n, ...] -> a fresh [rows, width, ...] (width: n when None; x [A] -> [rows]), x in its top-left corner,
    zeros elsewhere: a region's inputs span the static cache's batch bucket (and a row count's bucket), and a fresh
    tensor has the strides a graph guards on (a caller's slice has its whole tensor's)."""
    if x.dim() == 1:  # [A] -> [rows]
        out = x.new_zeros(rows)
        out[: x.shape[0]] = x
        return out
    out = x.new_zeros(rows, x.shape[1] if width is None else width, *x.shape[2:])
    out[: x.shape[0], : x.shape[1]] = x
    return out


def step_rows(n: int, prefill: bool) -> int:
    """A drafter's step over n new rows, padded to a bucket (one graph each); a prefill's rows as they are."""
    return n if prefill else next((k for k in BUCKETS if k >= n), n)


class Region:
    """A drafter's step as a compiled region (compile_region), built on its first compiled call; a prefill (the
    prompt's rows, any count) runs it eagerly, as the target's prefill."""

    def __init__(self, fn):
        self.fn, self._compiled = fn, None

    def __call__(self, cache: StaticCache, prefill: bool, *args):
        if prefill:
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = compile_region(self.fn, cache)
        return self._compiled(*args)


def compile_region(fn, cache: StaticCache):
    """fn compiled as the static cache's decoder is (its device and backend): a drafter's region that runs that decoder
    (`decode(..., laid_out=True)`) among its own tensor ops, e.g. a whole draft tree's levels and their growth."""
    return torch_compile(fn, cache.runner.device, cache.runner.backend)


def decode(decoder: nn.Module, cache, laid_out: bool = False, **inputs) -> torch.Tensor:
    """A drafter's decoder forward -> last hidden state [B, Q, H]: on a static cache, through the compiled decoder
    that built it (`laid_out`: inside the drafter's own compiled region, CompiledDecoder.laid_out); on any other cache
    (or none), the decoder's own forward, as always."""
    if isinstance(cache, StaticCache):
        if cache.runner is None or cache.runner.decoder is not decoder:
            raise SpecbenchError("model.compile: this static cache belongs to another decoder")
        if laid_out:
            return cache.runner.laid_out(cache, **inputs)
        return cache.runner.forward(cache, **inputs)[0]
    return decoder(past_key_values=cache, use_cache=cache is not None, **inputs).last_hidden_state
