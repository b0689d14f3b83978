"""TargetModel: the stock HF causal LM driven with explicit 4D tree masks, position ids and its own cache.

No forked modeling code: a tree forward is an ordinary forward of the decoder with an additive mask; the LM head is
applied only to the rows whose logits are needed. The cache is compacted to the accepted path after verification
(a gather along the sequence axis, since accepted tree nodes are not contiguous).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specbench.tree import is_chain, tree_attention_mask, tree_position_ids


@dataclass
class TargetForward:
    logits: torch.Tensor  # [B, R, V] logits of the requested rows
    hidden: torch.Tensor  # [B, Q, H] last hidden state (after the final norm) of every input position


class TargetModel:
    """Owns nothing but the model: each generation creates its own cache with `new_cache()`."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device, name: str):
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

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q]
        cache: DynamicCache,
        position_ids: torch.Tensor | None = None,  # [B, Q]
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, cached+Q] additive, or None = causal
        logits_rows: slice | torch.Tensor = slice(None),
    ) -> TargetForward:
        out = self.decoder(
            input_ids=input_ids,
            past_key_values=cache,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
        )
        hidden = out.last_hidden_state
        return TargetForward(logits=self.lm_head(hidden[:, logits_rows]).float(), hidden=hidden)

    def prefill(self, prompt: torch.Tensor, cache: DynamicCache) -> TargetForward:
        """prompt [B, L] -> logits of the last position [B, 1, V]; hidden [B, L, H]."""
        return self.forward(prompt, cache, logits_rows=slice(-1, None))

    def verify(self, root: torch.Tensor, tokens: torch.Tensor, parents: list[int], cache: DynamicCache) -> TargetForward:
        """One forward over [root, node_0..node_{N-1}]: root [B, 1], tokens [B, N] -> logits [B, N+1, V]."""
        prefix = cache.get_seq_length()
        ids = torch.cat([root, tokens], dim=1)
        pos = tree_position_ids(parents, prefix, self.device)
        # a chain (or a lone root) is what the causal mask already expresses: skip building a 4D mask
        mask = None if is_chain(parents) else tree_attention_mask(parents, prefix, self.dtype, self.device)
        return self.forward(ids, cache, position_ids=pos, attention_mask=mask)


def compact_cache(cache: DynamicCache, prefix_len: int, keep_nodes: list[int], num_nodes: int) -> None:
    """Keep the prefix, the root (at prefix_len) and the accepted nodes (at prefix_len + 1 + i); drop the rest."""
    if keep_nodes == list(range(len(keep_nodes))):  # a contiguous run after the root: a crop is enough
        cache.crop(-(num_nodes - len(keep_nodes)))
        return
    first = prefix_len + 1
    idx = torch.tensor(list(range(first)) + [first + i for i in keep_nodes], device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


def cache_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) views of the cache for drafters that read the target's key/values (MoA)."""
    return [(layer.keys, layer.values) for layer in cache.layers]
