"""TargetModel: the stock HF causal LM driven with explicit 4D tree masks, position ids and its own cache.

No forked modeling code: a tree forward is an ordinary forward of the decoder with an additive mask; the LM head is
applied only to the rows whose logits are needed. After verification the cache keeps the accepted path: its entries
are moved into place behind the root and the rest is dropped (EAGLE's way), never a rebuild of the prefix.

Every decode, at every batch size, runs on one kind of cache: the preallocated one (specbench/decode/kvcache.py), or
model.compile's static one. `verify` and `compact_cache` (one tree over a cache of one length) serve
specbench/tools/gpu_check.py's verify timing and the tests; the engine verifies through its own rows path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specbench.decode.compiled import CompiledDecoder, CompiledDecoders
from specbench.errors import SpecbenchError
from specbench.decode.kvcache import PreallocatedCache, StaticCache
from specbench.decode.rows import RowCounts

from specbench.decode.tree import tree_attention_mask, tree_position_ids


@dataclass
class TargetForward:
    logits: torch.Tensor  # [B, R, V] logits of the requested rows
    hidden: torch.Tensor  # [B, Q, H] last hidden state (after the final norm) of every input position
    layers: torch.Tensor | None = None  # [B, Q, k*H] the residual inputs of the requested layers, concatenated


class TargetModel:
    """Owns nothing but the model: each generation creates its own cache with `new_cache()`."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device, name: str,
                 compile: bool | str = False):
        cfg = model.config
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError(f"{cfg.model_type}: logit soft-capping is not supported by TargetModel")
        self.model, self.tokenizer, self.device, self.name = model, tokenizer, device, name
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
        self.compiled: CompiledDecoder | None = None  # model.compile: the target's decoder compiled, its static cache
        self.drafter_decoders: CompiledDecoders | None = None  # and the drafters' own decoders (EAGLE's head, sd's model)
        if compile:
            if len(self.devices) > 1:
                raise SpecbenchError("model.compile runs the target on one device (not with model.device_map)")
            self.compiled = CompiledDecoder(self.decoder, cfg, device, compile)
            self.drafter_decoders = CompiledDecoders(device, compile)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int | None = None, batch: int = 1, ragged: bool = False) -> Cache:
        """A fresh cache; `capacity`: the positions it will hold (a preallocated cache sizes its buffers to it; it
        grows past it if it must). ragged: the cache every decode runs on, `batch` rows each written at its own length:
        a PreallocatedCache (a target whose layers it cannot hold, sliding-window ones, is refused here in one line);
        compiled, the compiled decoder's one static cache for `batch` rows, cleared (specbench/decode/compiled.py:
        reused across generations, replaced when one needs more positions or another batch bucket). Not ragged: for
        a forward outside the engine (training features, gpu_check's verify timing, tests), transformers'
        DynamicCache (compiled: the static cache as above)."""
        if self.compiled is not None:
            return self.compiled.new_cache(capacity, batch)
        if ragged:
            return PreallocatedCache(self.model.config, capacity or 1024)
        return DynamicCache(config=self.model.config)

    def drafter_cache(self, config, capacity: int, decoder: nn.Module | None = None, rows: int = 1) -> Cache:
        """A drafter's own cache for `config`'s layers (specbench/decode/draftcache.py DraftCache, at every B): a
        preallocated cache of `capacity` positions, its `rows` rows each written at its own length (grown past the
        capacity if it must). Compiled, for a drafter that names its `decoder` and runs it through
        specbench.compiled.decode: that decoder's static cache for `rows` batch rows (its graphs built on it);
        a drafter whose layers are not an HF decoder (EAGLE-3, Beagle, MoA) names one of its modules as the key of a
        static cache of `config`'s layer count, which its own compiled regions write."""
        if self.drafter_decoders is not None and decoder is not None:
            # a static cache cannot grow: room for as much as the target's, which is sized to this generation
            held = self.compiled.capacity
            return self.drafter_decoders.cache(decoder, config, max(capacity, held), rows)
        return PreallocatedCache(config, capacity)

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

    def _forward_static(self, input_ids, cache: StaticCache, position_ids, attention_mask, logits_rows, layers):
        """forward() on model.compile's static cache: the decoder through specbench/decode/compiled.py (a tree padded to a
        bucket and compiled; a prefill eager on the same buffers), the LM head on the rows asked for."""
        hidden, picked = self.compiled.forward(cache, input_ids=input_ids, position_ids=position_ids,
                                               attention_mask=attention_mask, layers=layers)
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


def compact_rows(cache: PreallocatedCache, first: RowCounts, path: torch.Tensor, accepted: RowCounts,
                 contiguous: bool = False) -> None:
    """compact_cache for ragged rows (batched decoding): row r wrote its root at first[r] - 1 and its tree behind it;
    it keeps its prefix, the root and its accepted nodes path[r, :accepted[r]] (path order, then -1), copied into place
    behind the root with one gather and one scatter per layer for the whole batch; then row r holds first[r] +
    accepted[r] entries (the tree past them is stale). path [A, N] on the device; contiguous: every row's path is its
    nodes 0..A_r-1 (nothing to copy)."""
    amax = accepted.max()
    if amax and not contiguous:
        dst = first.dev[:, None] + torch.arange(amax, device=first.dev.device)  # [A, amax]
        keep = path[:, :amax]
        src = torch.where(keep >= 0, first.dev[:, None] + keep, dst)  # past a row's path: its entry onto itself
        for layer in cache.layers:
            layer.move_entries(src.to(layer._k.device), dst.to(layer._k.device))
    cache.set_row_lengths(first + accepted)


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
