"""MoA, Mixture of Attentions (Zimmer et al., papers/002 Sec. 3, App. A.1, A.3).

Information flow (Fig. 1, Algorithm 1):
  Layer Self-Attention (LSA): per verified token, the target's per-layer (K, V) [L, 2 E_kv] attend to each other across
    layers (bidirectional), then a mean over layers -> [2 E_kv]; computed once per drafting cycle for the newly
    verified tokens only (their activations do not change afterwards).
  Self-Attention (SA): causal self-attention over the token embeddings (prompt, verified and drafted tokens; tree
    mask while drafting) -> the draft queries.
  Cross-Attention (CA): SA outputs attend to the LSA outputs of verified tokens only (T-step bounded: drafted tokens
    have no target activations) -> o^_{L+1-TLI}, the activation entering the last TLI target layers.
  Target Layer Inference (TLI, Sec. 3.2): for TLI > 0 the last TLI target layers (frozen, shared) run on o^ with the
    target's cached K/V of verified tokens plus the drafter's own K/V of the drafted path, then the final norm and
    LM head; TLI = 0 feeds o^ to the LM head directly.
Training (Sec. 3.3, App. A.1): CA mask T-step bounded, the sequence cut into blocks of K ~ U{5..15} tokens whose
queries see activations only before their block (what drafting K tokens after a verification sees); loss
lambda0 KL(p_target || q) + lambda1 SmoothL1(o^, o) with lambda0 = 0.1, lambda1 = 1.0 (Table 6), where o is the
target's activation at the same place (its last hidden state for TLI = 0, the residual input of layer L+1-TLI else;
the features store both). During training the TLI layers see the true K/V before the block and the predicted K/V of
the block's own earlier positions, as while drafting.
Dimensions are Table 6's ratios scaled to the target (conf/drafter/moa.yaml): LSA width 2 E_kv with MLP 3x;
SA with the target's heads, one K/V head, MLP E/8; CA with the target's head counts, MLP 1.75 E.
Deviations: LSA adds a learned per-layer embedding (attention over layers is otherwise order-blind; the paper does
not say); CA uses RoPE at both sides' positions (as our Beagle block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specbench.drafter import KV, TrainableDrafter
from drafters.distill import kl, teacher_probs, top1
from drafters.layers import CrossAttentionBlock, one_layer_decoder, target_layer
from drafters.trees import GrowingTree, Level, make_tree
from specbench.target import kv_per_token
from specbench.tree import in_block, tree_attention_mask, up_to_start, visible
from specbench.types import DraftTree, TargetState, VerifyResult


class LayerSelfAttention(nn.Module):
    """[N, L, D] per-token stacks of per-layer (K, V) -> [N, D]: attention across layers, then the mean."""

    def __init__(self, layers: int, dim: int, head_dim: int, mlp: int, norm: type, eps: float):
        super().__init__()
        self.heads = max(1, dim // head_dim)
        if dim % self.heads:
            raise ValueError(f"LSA width {dim} is not a multiple of lsa_head_dim={head_dim}")
        self.in_norm, self.norm1, self.norm2 = norm(dim, eps=eps), norm(dim, eps=eps), norm(dim, eps=eps)
        self.layer_emb = nn.Parameter(torch.zeros(layers, dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, l, d = x.shape
        x = self.in_norm(x) + self.layer_emb
        q, k, v = self.qkv(self.norm1(x)).view(n, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, l, d))
        x = x + self.down(F.silu(self.up(self.norm2(x))))
        return x.mean(1)


class MoAModule(nn.Module):
    def __init__(self, target, tli: int, lsa_head_dim: int, lsa_mlp: int, sa_kv_heads: int, sa_mlp: int, ca_mlp: int):
        super().__init__()
        cfg = target.model.config
        nh = cfg.num_attention_heads
        nkv = getattr(cfg, "num_key_value_heads", None) or nh
        dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        self.tli, self.layers, self.kv_dim = tli, cfg.num_hidden_layers, 2 * nkv * dh
        self.lsa = LayerSelfAttention(self.layers, self.kv_dim, lsa_head_dim, lsa_mlp, type(target.decoder.norm),
                                      cfg.rms_norm_eps)
        self.sa = one_layer_decoder(target, num_key_value_heads=sa_kv_heads, intermediate_size=sa_mlp)
        self.ca = CrossAttentionBlock(target, kv_dim=self.kv_dim, intermediate=ca_mlp)

    def forward(self, emb: torch.Tensor, pos: torch.Tensor, sa_mask: torch.Tensor | None, lsa_in: torch.Tensor,
                ca_allowed: torch.Tensor) -> torch.Tensor:
        """Training: emb [B, T, H], pos [B, T], sa_mask (HF attention mask for SA), lsa_in [B, T, L, 2E_kv],
        ca_allowed [B, 1, T, T] -> o^ [B, T, H]."""
        b, t = emb.shape[:2]
        states = self.lsa(lsa_in.reshape(b * t, self.layers, -1)).view(b, t, -1)
        q = self.sa(inputs_embeds=emb, position_ids=pos, attention_mask=sa_mask).last_hidden_state
        return self.ca(q, pos, ca_allowed, states=states, states_pos=pos)


def bounded_starts(length: int, low: int, high: int, gen: torch.Generator | None, device) -> torch.Tensor:
    """n(q) for every position: blocks of K ~ U{low..high} tokens tile positions 1..length-1; a query sees target
    activations up to n(q) = (its block's first position) - 1. Position 0 gets -1 (nothing to see)."""
    starts, s = torch.full((length,), -1, dtype=torch.long), 1
    while s < length:
        k = int(torch.randint(low, high + 1, (1,), generator=gen))
        starts[s : s + k] = s - 1
        s += k
    return starts.to(device)


@dataclass
class MoAOptions:
    tli: int = 0  # target layers run after the drafter (0: the drafter predicts the last hidden state)
    lsa_head_dim: int = 64
    lsa_mlp: int = 1152
    sa_kv_heads: int = 1
    sa_mlp: int = 72
    ca_mlp: int = 1008
    block_min: int = 5  # training: the T-step-bounded CA mask's block sizes ~ U{block_min..block_max} (Table 6)
    block_max: int = 15


class MoADrafter(TrainableDrafter):
    name = "moa"
    needs = frozenset({KV})
    Options = MoAOptions
    lambda_kl, lambda_reg = 0.1, 1.0  # Table 6

    def __init__(self, target, checkpoint: str | None = None, module: dict | None = None, tree: dict | None = None,
                 net: MoAModule | None = None):
        """`net`: draft with this module as it is (validation drafts with the module being trained), instead of
        loading `checkpoint`."""
        self.net = net if net is not None else self.load_module(target, checkpoint, module)
        self.policy = make_tree(**(tree or {"kind": "dynamic"}))
        self.embed, self.lm_head, self.device = target.decoder.embed_tokens, target.lm_head, target.device
        self.final_norm, self.rotary = target.decoder.norm, target.decoder.rotary_emb
        self.tli_layers = list(target.decoder.layers[len(target.decoder.layers) - self.net.tli :])  # frozen, shared
        self.reset()

    def reset(self) -> None:
        self.ca_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # CA keys/values of verified activations
        self.acts = 0  # verified tokens whose activations are in ca_kv (and in the TLI caches)
        self.sa_cache: DynamicCache | None = None
        self.sa_len = 0
        self.tli_kv: list[list[torch.Tensor]] = []  # per TLI layer [K, V] [1, nkv, n, dh]

    # ---- training side -------------------------------------------------------------------------------------------
    @classmethod
    def build_module(cls, target, opts: MoAOptions) -> MoAModule:
        if not 0 <= opts.tli < target.model.config.num_hidden_layers:
            raise ValueError(f"tli={opts.tli} must be in [0, {target.model.config.num_hidden_layers})")
        return MoAModule(target, opts.tli, opts.lsa_head_dim, opts.lsa_mlp, opts.sa_kv_heads, opts.sa_mlp,
                         opts.ca_mlp).to(target.device)

    @staticmethod
    def _layer_kv(kv: torch.Tensor, layer: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [B, T, L, 2 nkv dh] -> the layer's (K, V) [B, nkv, T, dh]."""
        b, t = kv.shape[:2]
        k, v = kv[:, :, layer].chunk(2, -1)
        return k.reshape(b, t, nkv, -1).transpose(1, 2), v.reshape(b, t, nkv, -1).transpose(1, 2)

    @classmethod
    def predict(cls, net, target, ids, kv, pre_pad, starts, rows: torch.Tensor | None = None):
        """Teacher-forced T-step-bounded prediction: ids [B, T], kv [B, T, L, 2E_kv], pre_pad [B, T] (1 = real),
        starts [T] = n(q) -> (o^ [B, T, H], logits [B, T, V]); with `rows` [B, T] bool the 49k-row LM head runs only
        there (logits [M, V]: training needs them at loss positions only)."""
        b, t = ids.shape
        dev = ids.device
        idx = torch.arange(t, device=dev)
        pos = idx[None].expand(b, -1)
        real = pre_pad.bool()
        ca_allowed = up_to_start(starts, real)  # [B, T, T] activations before the block
        out = net(target.decoder.embed_tokens(ids), pos, pre_pad, kv, ca_allowed[:, None])
        x = out
        if net.tli:
            nkv = target.decoder.layers[0].self_attn.k_proj.out_features // target.decoder.layers[0].self_attn.head_dim
            first = len(target.decoder.layers) - net.tli
            see_pred = in_block(starts, include_self=True)  # the block's own drafted path, up to itself
            allowed = torch.cat([ca_allowed, see_pred[None].expand(b, -1, -1) & real[:, None, :]], -1)[:, None]
            for i, layer in enumerate(target.decoder.layers[first:]):
                k, v = cls._layer_kv(kv, first + i, nkv)
                x, _, _ = target_layer(layer, target.decoder.rotary_emb, x, pos, k, v, allowed)
        x = target.decoder.norm(x) if net.tli else x
        if rows is not None:
            x = x[rows]
        return out, target.lm_head(x.to(target.dtype)).float()

    @classmethod
    def training_loss(cls, module, batch, target, opts: MoAOptions):
        t = batch.input_ids.shape[1]
        starts = bounded_starts(t, opts.block_min, opts.block_max, None, batch.input_ids.device)
        rows = torch.zeros_like(batch.attn_mask, dtype=torch.bool)
        rows[:, :-1] = batch.loss_mask[:, 1:].bool()  # the query at q predicts t_{q+1}
        rows &= (starts >= 0)[None]
        out, logits = cls.predict(module, target, batch.input_ids, batch.kv, batch.attn_mask, starts, rows)
        true = batch.hidden if module.tli == 0 else batch.pre[:, :, module.tli - 1]
        p = teacher_probs(target, batch.hidden[rows])  # [M, V]
        logq = logits.log_softmax(-1)
        kl_loss = kl(p, logq)
        reg = F.smooth_l1_loss(out[rows], true[rows], reduction="none").mean(-1).mean()
        return cls.lambda_kl * kl_loss + cls.lambda_reg * reg, {"kl": kl_loss.item(), "reg": reg.item(),
                                                                "top1": top1(logq, p)}

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        """Greedy chains through the decoding path itself (the target's K/V recomputed for the prefix)."""
        from specbench.target import cache_kv

        d = cls(target, net=module)  # the decoding path around the module being trained
        out = []
        for t in positions:
            d.prefill(None)
            cache = target.new_cache()
            target.forward(input_ids[None, :t], cache, logits_rows=slice(0, 0))
            state = TargetState(tokens=input_ids[None, : t + 1], hidden=None, kv=cache_kv(cache, target.device))
            row, toks = [], input_ids[None, : t + 1]
            for _ in range(depth):  # a chain: the next row sees the same activations and the drafted tokens before it
                nxt = d._root_logits(toks, state).argmax(-1).view(1, 1)
                row.append(nxt[0, 0])
                toks = torch.cat([toks, nxt], 1)
            out.append(torch.stack(row))
        return torch.stack(out)

    # ---- decoding side -------------------------------------------------------------------------------------------
    def prefill(self, state: TargetState | None) -> None:
        self.reset()
        self.sa_cache = DynamicCache(config=self.net.sa.config)

    def _absorb(self, state: TargetState) -> None:
        """LSA (+ CA keys) and TLI caches for the activations verified since the last cycle."""
        n = state.kv[0][0].shape[2]
        if n == self.acts:
            return
        new = slice(self.acts, n)
        per_layer = [kv_per_token(k[0, :, new], v[0, :, new]) for k, v in state.kv]  # L x [m, 2E_kv]
        wdt = self.net.ca.q_proj.weight.dtype
        states = self.net.lsa(torch.stack(per_layer, 1).to(wdt))[None]  # [1, m, 2E_kv]
        pos = torch.arange(self.acts, n, device=self.device)[None]
        k, v = self.net.ca.keys(states, pos)
        self.ca_kv = (k, v) if self.ca_kv is None else (torch.cat([self.ca_kv[0], k], 2), torch.cat([self.ca_kv[1], v], 2))
        first = len(state.kv) - self.net.tli
        for i in range(self.net.tli):
            k, v = state.kv[first + i]
            if len(self.tli_kv) <= i:
                self.tli_kv.append([k[:, :, :n].clone(), v[:, :, :n].clone()])
            else:
                self.tli_kv[i] = [torch.cat([self.tli_kv[i][0], k[:, :, new]], 2),
                                  torch.cat([self.tli_kv[i][1], v[:, :, new]], 2)]
        self.acts = n

    def _rows(self, tokens: torch.Tensor, pos: int, sa_seen: torch.Tensor, tli_seen: torch.Tensor) -> torch.Tensor:
        """Draft rows tokens [R] at position pos: SA over the tree (sa_seen [R, S]: the drafted SA slots each row sees
        besides the verified tokens, itself included), CA over verified activations, TLI layers (tli_seen [R, S']: its
        TLI slots besides the verified activations, the root's own first) -> logits [R, V]."""
        wdt = self.net.ca.q_proj.weight.dtype
        r = tokens.shape[0]
        p = torch.full((1, r), pos, device=self.device)
        q = self.net.sa(inputs_embeds=self.embed(tokens[None]).to(wdt), past_key_values=self.sa_cache,
                        position_ids=p, attention_mask=tree_attention_mask(sa_seen, self.sa_len, wdt),
                        use_cache=True).last_hidden_state
        ca_allowed = visible(torch.zeros(r, 0, dtype=torch.bool, device=self.device), self.acts)  # every activation
        x = self.net.ca(q, p, ca_allowed, kv=self.ca_kv)
        if self.net.tli:
            allowed = visible(tli_seen, self.acts)  # [1, 1, R, acts + S']
            for i, layer in enumerate(self.tli_layers):
                kc, vc = self.tli_kv[i]
                x, k, v = target_layer(layer, self.rotary, x.to(kc.dtype), p, kc, vc, allowed)
                self.tli_kv[i] = [torch.cat([kc, k], 2), torch.cat([vc, v], 2)]
            x = self.final_norm(x)
        return self.lm_head(x.to(self.lm_head.weight.dtype))[0]

    def _root_logits(self, toks: torch.Tensor, state: TargetState) -> torch.Tensor:
        """Absorb new activations, run SA over the new verified tokens (the root last), draft the root's row."""
        self._absorb(state)
        n = toks.shape[1]
        wdt = self.net.ca.q_proj.weight.dtype
        new = toks[:, self.sa_len : n - 1]
        if new.shape[1]:
            self.net.sa(inputs_embeds=self.embed(new).to(wdt), past_key_values=self.sa_cache,
                        position_ids=torch.arange(self.sa_len, n - 1, device=self.device)[None], use_cache=True)
            self.sa_len = n - 1
        # the root's TLI slot; in validation chains earlier drafted tokens stay in the TLI caches and are seen too
        own = (self.tli_kv[0][0].shape[2] if self.net.tli else self.acts) + 1 - self.acts
        ones = lambda k: torch.ones(1, k, dtype=torch.bool, device=self.device)  # noqa: E731
        logits = self._rows(toks[0, -1:], n - 1, ones(1), ones(own))[0]
        self.sa_len = n  # the root is a verified token: its SA entry stays
        return logits

    def crop(self) -> None:
        """Drop drafted entries: SA keeps the verified tokens (root included), TLI the verified activations."""
        extra = self.sa_cache.get_seq_length() - self.sa_len
        if extra > 0:
            self.sa_cache.crop(-extra)
        self.tli_kv = [[k[:, :, : self.acts], v[:, :, : self.acts]] for k, v in self.tli_kv]

    @torch.inference_mode()
    def propose(self, state: TargetState) -> DraftTree:
        toks = state.tokens
        root_logits = self._root_logits(toks, state)
        root_pos = toks.shape[1] - 1
        book = GrowingTree(self.policy.max_nodes, self.device)  # slots: the drafted SA entries

        def expand(level: Level) -> torch.Tensor:
            sa_seen = book.add(level.nodes, level.parents)
            # TLI entries are appended in the same order, after the root's own (seen by every row)
            tli_seen = torch.cat([sa_seen.new_ones(sa_seen.shape[0], 1), sa_seen], -1)
            return self._rows(level.tokens, root_pos + level.depth, sa_seen, tli_seen)

        grown = self.policy.grow(root_logits, expand)
        self.crop()
        return grown.draft()

    def on_verified(self, result: VerifyResult, state: TargetState) -> None:
        pass  # everything the next cycle needs is read from state.kv / state.tokens in propose
