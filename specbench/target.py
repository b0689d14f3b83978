"""TargetModel: the stock HF causal LM driven with explicit 4D tree masks, position ids and its own cache.

No forked modeling code: a tree forward is an ordinary forward of the decoder with an additive mask; the LM head is
applied only to the rows whose logits are needed. After verification the cache keeps the accepted path: its entries
are moved into place behind the root and the rest is cropped (EAGLE's way), never a rebuild of the prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specbench.errors import SpecbenchError
from specbench.kvcache import PreallocatedCache, StaticCache

from specbench.tree import tree_attention_mask, tree_position_ids

CACHES = ("dynamic", "preallocated")  # model.cache
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # model.compile: tree forwards padded to these row counts (one graph each)
STATIC_BLOCK = 256  # model.compile: static caches, and the context attention reads, in blocks of this many positions


@dataclass
class TargetForward:
    logits: torch.Tensor  # [B, R, V] logits of the requested rows
    hidden: torch.Tensor  # [B, Q, H] last hidden state (after the final norm) of every input position
    layers: torch.Tensor | None = None  # [B, Q, k*H] the residual inputs of the requested layers, concatenated


class TargetModel:
    """Owns nothing but the model: each generation creates its own cache with `new_cache()`."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device, name: str,
                 cache: str = "dynamic", compile: bool | str = False):
        cfg = model.config
        if cache not in CACHES:
            raise SpecbenchError(f"model.cache={cache!r} is not one of {', '.join(CACHES)}")
        if cache == "preallocated":
            PreallocatedCache(cfg, 1)  # a config it cannot hold fails here, in one line, not mid-run
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError(f"{cfg.model_type}: logit soft-capping is not supported by TargetModel")
        self.model, self.tokenizer, self.device, self.name, self.cache = model, tokenizer, device, name, cache
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.hidden_size = cfg.hidden_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # every device the model computes on (several under model.device_map): what timing syncs and memory reads
        self.devices: tuple[torch.device, ...] = tuple(sorted({p.device for p in model.parameters()}, key=str)) or (device,)
        self.compiled = None  # model.compile: the compiled tree forward (_static_step) and its static caches
        self._static: StaticCache | None = None  # the largest a generation asked for so far, reused
        if compile:
            if len(self.devices) > 1:
                raise SpecbenchError("model.compile runs the target on one device (not with model.device_map)")
            import torch._dynamo

            # one graph per (tree bucket, context block): more than dynamo's default of 8 before it gives up on a function
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
            # compile=True: inductor (with CUDA graphs on CUDA); a string names another torch.compile backend (tests)
            backend = compile if isinstance(compile, str) else "inductor"
            cuda_graphs = backend == "inductor" and device.type == "cuda"
            self.compiled = torch.compile(self._static_step, dynamic=False, backend=backend,
                                          mode="reduce-overhead" if cuda_graphs else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int | None = None) -> Cache:
        """A fresh cache for one generation; `capacity`: the positions it will hold (a preallocated cache sizes its
        buffers to it; it grows past it if it must). Compiled: one static cache, reused across generations since the
        compiled graphs are built on its buffers, replaced by a larger one (positions rounded up to STATIC_BLOCK, room
        for a padded tree included) only when a generation needs more; attention reads only the context block in use,
        so a larger buffer costs memory, not time."""
        if self.compiled is not None:
            need = (capacity or 1024) + max(BUCKETS)  # room for a padded tree
            if self._static is None or self._static.capacity < need:  # (a new buffer: its graphs are built anew)
                self._static = StaticCache(self.model.config, STATIC_BLOCK * -(-need // STATIC_BLOCK), self.device)
            self._static.reset()
            return self._static
        if self.cache == "preallocated":
            return PreallocatedCache(self.model.config, capacity or 1024)
        return DynamicCache(config=self.model.config)

    def drafter_cache(self, config, capacity: int) -> Cache:
        """A cache of the target's kind (model.cache) for a drafter's own decoder of `config` (EAGLE's head, sd's
        draft model): `capacity` positions, grown past them if it must."""
        if self.cache == "preallocated":
            return PreallocatedCache(config, capacity)
        return DynamicCache(config=config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q]
        cache: Cache,
        position_ids: torch.Tensor | None = None,  # [B, Q]
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, cached+Q] additive, or None = causal
        logits_rows: slice | torch.Tensor = slice(None),
        layers: tuple[int, ...] = (),  # hidden_states indices whose rows come back in TargetForward.layers
    ) -> TargetForward:
        if isinstance(cache, StaticCache):
            return self._forward_static(input_ids, cache, position_ids, attention_mask, logits_rows, layers)
        out = self.decoder(
            input_ids=input_ids,
            past_key_values=cache,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, logits_rows]).float()
        # with a device map the last layers and the LM head may sit elsewhere: back to the engine's device (no-op else)
        picked = torch.cat([out.hidden_states[i].to(self.device) for i in layers], -1) if layers else None
        return TargetForward(logits=logits.to(self.device), hidden=hidden.to(self.device), layers=picked)

    def _static_step(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: StaticCache,
                     layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward model.compile compiles: static shapes (ids [B, Q] with Q a bucket, mask [B, 1, Q, capacity]),
        the cache written at its device-side offset, nothing read on the host."""
        out = self.decoder(input_ids=ids, past_key_values=cache, position_ids=pos, attention_mask=mask, use_cache=True,
                           output_hidden_states=bool(layers))
        picked = torch.cat([out.hidden_states[i] for i in layers], -1) if layers else None
        return out.last_hidden_state, picked

    def _forward_static(self, input_ids, cache: StaticCache, position_ids, attention_mask, logits_rows, layers):
        """forward() on model.compile's static cache. A tree forward (Q <= the largest bucket) is padded to the next
        bucket (padding rows: token 0 at the root's position, seeing the first cached entry; written past the length
        that counts, so stale) and runs compiled; a prefill runs eagerly on the same buffers. Attention reads the cache
        up to the end of the current STATIC_BLOCK-sized context block (one graph per bucket and block), the mask
        (causal when None) widened to it: the columns not in use are hidden."""
        b, q = input_ids.shape
        n = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(n, n + q, device=input_ids.device)[None].expand(b, -1)
        if attention_mask is None:  # causal: the prefix and the rows up to itself (a chain's tree mask)
            chain = torch.ones(q, q, dtype=torch.bool, device=input_ids.device).tril()
            attention_mask = tree_attention_mask(chain, n, self.dtype)
        pad = next((k for k in BUCKETS if k >= q), None) if n > 0 else None  # a prefill (n = 0) is not compiled
        rows = q if pad is None else pad
        width = cache.begin(rows, STATIC_BLOCK)
        mask = attention_mask.new_full((b, 1, rows, width), torch.finfo(attention_mask.dtype).min)
        mask[:, :, :q, : n + q] = attention_mask
        ids, pos = input_ids, position_ids
        if rows > q:
            mask[:, :, q:, 0] = 0.0
            ids = torch.cat([input_ids, input_ids.new_zeros(b, rows - q)], 1)
            pos = torch.cat([position_ids, position_ids[:, :1].expand(b, rows - q)], 1)
        step = self._static_step if pad is None else self.compiled
        hidden, picked = step(ids, pos, mask, cache, tuple(layers))
        cache.advance(q)
        hidden, picked = hidden[:, :q], None if picked is None else picked[:, :q]
        return TargetForward(logits=self.lm_head(hidden[:, logits_rows]).float(), hidden=hidden, layers=picked)

    def prefill(self, prompt: torch.Tensor, cache: Cache, layers: tuple[int, ...] = ()) -> TargetForward:
        """prompt [B, L] -> logits of the last position [B, 1, V]; hidden [B, L, H]."""
        return self.forward(prompt, cache, logits_rows=slice(-1, None), layers=layers)

    def verify(self, root: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor, cache: Cache,
               causal: bool = False, layers: tuple[int, ...] = ()) -> TargetForward:
        """One forward over [root, node_0..node_{N-1}]: root [B, 1], tokens [B, N], anc [N+1, N+1] (the tree's
        ancestor_matrix) -> logits [B, N+1, V]. causal=True: the tree is a chain (or a lone root), which the model's
        own causal mask already expresses, so no 4D mask is built. `layers`: hidden_states indices (HF's: 0 the
        embeddings, i the input of layer i) whose rows an EAGLE-3 drafter reads, in TargetForward.layers."""
        prefix = cache.get_seq_length()
        ids = torch.cat([root, tokens], dim=1)
        pos = tree_position_ids(anc, prefix)
        mask = None if causal else tree_attention_mask(anc, prefix, self.dtype)
        return self.forward(ids, cache, position_ids=pos, attention_mask=mask, layers=layers)


def compact_cache(cache: Cache, prefix_len: int, keep: torch.Tensor, contiguous: bool) -> None:
    """Keep the prefix, the root (at prefix_len) and the accepted nodes keep [A] (node i at prefix_len + 1 + i, in
    path order); drop the rest. The A accepted entries are copied into place behind the root, then every layer is
    cropped: O(A) copies per layer, whatever the context. contiguous: the path is nodes 0..A-1 (a crop is enough).
    Each layer's index lives on that layer's device (a target spread over several devices)."""
    first = prefix_len + 1
    a = keep.shape[0]
    if not contiguous:
        src = keep + first  # [A] where the accepted entries were written
        for layer in cache.layers:
            idx = src.to(layer.keys.device, non_blocking=True)
            layer.keys[..., first : first + a, :] = layer.keys.index_select(-2, idx)
            layer.values[..., first : first + a, :] = layer.values.index_select(-2, idx)
    cache.crop(first + a - cache.get_seq_length())  # transformers' crop takes minus the number of entries to drop


def compact_rows(cache: PreallocatedCache, firsts: list[int], keeps: list[torch.Tensor], contiguous: list[bool]) -> None:
    """compact_cache for ragged rows (batched decoding): row r wrote its root at firsts[r] - 1 and its tree behind it;
    it keeps its prefix, the root and the accepted nodes keeps[r] [A_r] (path order), copied into place behind the
    root in every layer; then each row's length is set to firsts[r] + A_r (the tree entries past it are stale)."""
    for r, (first, keep, cont) in enumerate(zip(firsts, keeps, contiguous)):
        a = keep.shape[0]
        if cont or a == 0:
            continue
        for layer in cache.layers:
            idx = (keep + first).to(layer.keys.device, non_blocking=True)
            layer.keys[r, :, first : first + a] = layer.keys[r].index_select(-2, idx)
            layer.values[r, :, first : first + a] = layer.values[r].index_select(-2, idx)
    cache.set_row_lengths([first + keep.shape[0] for first, keep in zip(firsts, keeps)])


def row_kv(cache: Cache, row: int, length: int, device: torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """cache_kv of one batch row's `length` entries, [1, kv_heads, length, head_dim] per layer (batched decoding)."""
    return [(k[row : row + 1, :, :length], v[row : row + 1, :, :length]) for k, v in cache_kv(cache, device)]


def kv_per_token(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One layer's (K, V) [..., kv_heads, T, head_dim] as one row per token, [..., T, 2 * kv_heads * head_dim], per KV
    head [K_h | V_h], heads side by side: the layout MoA reads (its training features, stored or online, and its
    drafting), its authors' `torch.cat(kv, dim=-1).permute(0, 2, 1, 3).reshape(b, t, -1)`."""
    return torch.cat([k, v], -1).transpose(-3, -2).flatten(-2)


def cache_kv(cache: Cache, device: torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of the cache for drafters that read the target's key/values (MoA): views where a layer sits on
    `device` (the drafter's, the engine's), copies where a device map put it on another GPU."""
    move = (lambda x: x) if device is None else (lambda x: x.to(device, non_blocking=True))
    return [(move(layer.keys), move(layer.values)) for layer in cache.layers]
