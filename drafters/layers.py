"""Building blocks that several drafters use, in one place: a one-layer decoder of the target's architecture (EAGLE's
head body, MoA's self-attention layer), the cross-attention (Beagle's drafter, MoA's CA layer) and one frozen
target decoder layer run functionally on new rows (MoA's Target Layer Inference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def layers_config(target, layers: int = 1, **overrides):
    """The target's config (with `overrides`) for `layers` decoder layers of its first layer's kind: what a one-layer
    decoder is built from, and what a drafter's static cache is sized by (model.compile: Beagle's cross-attention
    keys, MoA's SA and TLI layers)."""
    base = target.model.config
    cfg = base.__class__.from_dict({**base.to_dict(), **overrides})
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1] * layers
    return cfg


def dims(cfg) -> tuple[int, int, int, int]:
    """(width, query heads, KV heads, head size) of a config."""
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    return cfg.hidden_size, nh, nkv, getattr(cfg, "head_dim", None) or cfg.hidden_size // nh


def one_layer_decoder(target, **overrides) -> nn.Module:
    """A one-layer decoder of the target's architecture (its attention, positions, MLP; config `overrides`), fed
    with inputs_embeds: no token table, no final norm (outputs feed the target's LM head or another layer)."""
    cfg = layers_config(target, **overrides)
    cfg.vocab_size, cfg.pad_token_id = 1, None  # no token table of its own
    body = type(target.decoder)(cfg)
    body.embed_tokens = None
    body.norm = nn.Identity()
    return body


class CrossAttend(nn.Module):
    """What Beagle's block and MoA's CA layer compute alike, their parameters named apart (each as its authors' name
    them; a subclass has them as q_proj, k_proj, v_proj, o_proj, q_norm, kv_norm, post_norm, mlp, rotary, and the head
    counts nh, nkv, dh): queries from one side's rows, keys/values from the other side's states, RoPE at each side's
    own positions, the residual on the queries, a gated MLP after a norm."""

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x, pos)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    def keys(self, states: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states [B, K, H] at positions pos [B, K] -> K, V [B, nkv, K, dh] (RoPE on K)."""
        b, n, _ = states.shape
        x = self.kv_norm(states)
        k = self.k_proj(x).view(b, n, self.nkv, self.dh).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.nkv, self.dh).transpose(1, 2)
        return self._rope(k, pos), v

    def forward(self, emb: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, states: torch.Tensor | None = None,
                states_pos: torch.Tensor | None = None) -> torch.Tensor:
        """emb [B, Q, H] at positions pos [B, Q]; keys/values either cached (kv: K, V [B, nkv, K, dh]) or projected
        here from states [B, K, H] at states_pos [B, K] (training); allowed
        [B, 1, Q, K] bool, every row needs one True -> predicted states [B, Q, H]."""
        k, v = kv if kv is not None else self.keys(states, states_pos)
        b, n, _ = emb.shape
        q = self.q_proj(self.q_norm(emb)).view(b, n, self.nh, self.dh).transpose(1, 2)
        q = self._rope(q, pos)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.nh != self.nkv)
        y = emb + self.o_proj(o.transpose(1, 2).reshape(b, n, self.nh * self.dh))
        return y + self.mlp(self.post_norm(y))


class CrossAttentionBlock(CrossAttend):
    """Beagle's cross-attention block: queries from [.., H] inputs, keys/values from [.., H] states, a norm for each
    side, the target's attention bias, head counts and MLP."""

    def __init__(self, target):
        super().__init__()
        cfg = target.model.config
        h, nh, nkv, dh = dims(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        norm = type(target.decoder.norm)
        self.nh, self.nkv, self.dh = nh, nkv, dh
        self.q_norm, self.post_norm = norm(h, eps=cfg.rms_norm_eps), norm(h, eps=cfg.rms_norm_eps)
        self.kv_norm = norm(h, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, nh * dh, bias=bias)
        self.k_proj = nn.Linear(h, nkv * dh, bias=bias)
        self.v_proj = nn.Linear(h, nkv * dh, bias=bias)
        self.o_proj = nn.Linear(nh * dh, h, bias=bias)
        self.mlp = type(target.decoder.layers[0].mlp)(cfg)
        self.rotary = type(target.decoder.rotary_emb)(config=cfg)


def target_layer(layer, rotary, x: torch.Tensor, pos: torch.Tensor, past_k: torch.Tensor | None,
                 past_v: torch.Tensor | None, allowed: torch.Tensor, into=None):
    """One frozen target decoder layer (Llama family) on new rows x [B, Q, H] at pos [B, Q], over cached K/V
    [B, nkv, P, dh] and the rows' own; allowed [B, 1, Q, P+Q] bool -> (out [B, Q, H], K, V of the rows), on x's
    device. Under a device map the layer may sit on another GPU: it computes there (its inputs go to it).
    into: a cache layer (ragged rows) that the rows' K, V are written into (each row behind its own entries) and whose
    whole buffer is attended over, instead of past_k / past_v with the rows' own appended; allowed then spans it. It
    stays on x's device (the drafter's): the rows' K, V go to it, the whole comes back to the layer's."""
    home, there = x.device, layer.self_attn.q_proj.weight.device
    x, pos, allowed = x.to(there), pos.to(there), allowed.to(there)  # (no-ops on one device)
    attn = layer.self_attn
    b, n, _ = x.shape
    dh = attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b, n, -1, dh).transpose(1, 2)
    k = attn.k_proj(h).view(b, n, -1, dh).transpose(1, 2)
    v = attn.v_proj(h).view(b, n, -1, dh).transpose(1, 2)
    cos, sin = rotary(x, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if into is not None:
        keys, vals = (t.to(there) for t in into.update(k.to(home, x.dtype), v.to(home, x.dtype)))
    else:
        past_k, past_v = past_k.to(there), past_v.to(there)
        keys, vals = torch.cat([past_k, k.to(past_k.dtype)], 2), torch.cat([past_v, v.to(past_v.dtype)], 2)
    o = F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=allowed, scale=attn.scaling,
                                       enable_gqa=q.shape[1] != keys.shape[1])
    x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
    return (x + layer.mlp(layer.post_attention_layernorm(x))).to(home), k.to(home), v.to(home)
