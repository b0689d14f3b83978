"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840), as its authors' code defines it (SafeAILab/EAGLE: `eagle/traineagle3/`
for training, `eagle/model/cnets.py` for drafting; read, not copied), on the shared engine with EAGLE-2's tree.

Features. The target's hidden states at three depths, low / middle / high: the inputs of target layers 2, L//2 and
L-3 (HF hidden_states[2], [L//2], [L-3]; the authors collect `hidden_states` before those layers), concatenated and
fused by fc: Linear(3H, H), no bias. No feature is regressed: the head only has to predict tokens.

Head ("midlayer", one decoder layer whose attention reads 2H):
    residual = h                                          h = fc(features) at a verified token, else the head's own
    x = cat(input_layernorm(e(t)), hidden_norm(h))        [.., 2H], the token's embedding first (the target's table)
    h = residual + o_proj(Attn(q_proj(x), k_proj(x), v_proj(x)))          q/k/v: 2H -> heads, no bias, RoPE
    h = h + mlp(post_attention_layernorm(h))              the target's gated MLP
    logits = lm_head(norm(h))                             over the draft vocabulary of N tokens (its own head)
The un-normed h is what a drafted node hands its children (fed back without fc).

Draft vocabulary (d2t / t2d). The N tokens most frequent in the training answers (the loss positions), sorted by id:
draft id i is target id i + d2t[i]; t2d [V] marks the target ids in it. Drafted ids are mapped back to target ids
(logits scattered into the target's vocabulary, -inf elsewhere, as vLLM's compute_logits), so the tree holds target
ids and the target verifies them: lossless whatever N is.

Training-time test (TTT), `self.length = 7` steps. Step 0 reads the target's fused features; step i > 0 reads step
i-1's outputs (not detached: one graph through all steps) with the tokens shifted by i, so at step i position t holds
token x[t+1+i] at RoPE position t+i and predicts x[t+2+i]: the i-th drafted token of a chain rooted at t. Its query
sees step 0's keys at positions <= t (the verified context) and the keys of steps 1..i at position t only (its chain's
drafted ancestors and itself), one softmax over both: exactly what a drafted node sees at decoding time.
Loss: sum_i 0.8^i CE(p_i, q_i), where p is the target's next-token law restricted to the draft vocabulary and
renormalised (softmax of its logits at the t2d ids) and positions whose target top-1 lies outside the draft
vocabulary are dropped (the authors' position_mask).

Deviations from the authors' code (stated):
- the loss mask is the predicted token's (x[t+2+i] an answer token), as for the whole EAGLE family here; theirs is
  loss_mask[t+i], two positions earlier (see docs/drafters.md);
- each step's loss is divided by the number of real positions (theirs: by every position of the padded batch;
  `module.loss_norm: padded` trains theirs);
- a head trained here uses the target's RoPE base (`rope_theta: null`); the authors' configs carry none and their code
  uses 10000, which a published head's config gets when it carries none;
- the draft vocabulary's size N follows a stated rule (conf/drafter/eagle3.yaml: the fewest ids covering 99.5% of
  the training answers' tokens, rounded up to a multiple of 1,024: 10,240 on SmolLM2), not the authors' fixed 32,000
  (a quarter of Llama-3's vocabulary).
The budget's optimiser is every method's (conf/train); the authors' (lr 5e-5, warm-up 12k steps, 40 epochs, fp16) is
for their data: their 5e-5 peak on the embedded budget validates at sim tau 1.247 after epoch 1, against 1.502 at the
budget's 3e-4 (docs/training.md).

With model.compile the head's K, V live on a static cache of the batch's bucket; its step over newly verified pairs and
the whole tree's growth each run as a compiled region (specbench/decode/draftcache.py CompiledTree; issue 48).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import save_file
from transformers.cache_utils import CacheLayerMixin, DynamicLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from drafters.trees import Grown, grow_by_features, make_tree
from specbench.decode.checkpoints import authors_config, copy_state, read_state, rope_theta
from specbench.decode.compiled import Region
from specbench.decode.draftcache import CachedRows, CompiledTree, DraftCache
from specbench.decode.drafter import LAYERS, TrainableDrafter
from specbench.errors import SpecbenchError
from specbench.decode.types import DraftTree, TargetState
from specbench.decode.vocab import covering_size, frequent_ids


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The authors' low / middle / high layers (hidden_states indices: the inputs of layers 2, L//2 and L-3)."""
    return 2, num_layers // 2, num_layers - 3


class Eagle3Layer(nn.Module):
    """The authors' `midlayer`: one decoder layer over [e(t) ; h] (2H) with the residual on h. Parameter names are
    theirs (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, hidden_norm, input_layernorm, post_attention_layernorm),
    so their checkpoints load by name."""

    def __init__(self, target, cfg):
        super().__init__()
        h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.nh, self.nkv, self.dh = nh, nkv, h // nh
        self.rms_norm_eps = cfg.rms_norm_eps
        self.rope_theta = rope_theta(cfg)
        norm = type(target.decoder.norm)
        self.hidden_norm = norm(h, eps=cfg.rms_norm_eps)
        self.input_layernorm = norm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(h, eps=cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, nh * self.dh, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, nkv * self.dh, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, nkv * self.dh, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * self.dh, h, bias=False)
        self.mlp = type(target.decoder.layers[0].mlp)(cfg)
        self.rotary = type(target.decoder.rotary_emb)(config=cfg)

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor):
        """emb, h [B, Q, H] at positions pos [B, Q] -> q [B, nh, Q, dh], k, v [B, nkv, Q, dh] (RoPE on q and k)."""
        b, n, _ = h.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
        a = self.self_attn
        q = a.q_proj(x).view(b, n, self.nh, self.dh).transpose(1, 2)
        k = a.k_proj(x).view(b, n, self.nkv, self.dh).transpose(1, 2)
        v = a.v_proj(x).view(b, n, self.nkv, self.dh).transpose(1, 2)
        cos, sin = self.rotary(x, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Attention output o [B, nh, Q, dh] and the residual h [B, Q, H] -> the layer's (un-normed) output."""
        b, _, n, _ = o.shape
        h = h + self.self_attn.o_proj(o.transpose(1, 2).reshape(b, n, self.nh * self.dh))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head over the draft vocabulary, d2t (a frozen integer parameter, saved with the
    weights) and t2d (derived from d2t). `layers`: the target's hidden_states indices fused by fc."""

    def __init__(self, target, cfg, layers: tuple[int, ...], draft_vocab: int, fc_in: int):
        super().__init__()
        self.layers = tuple(layers)
        self.config = cfg  # the one layer's (model.compile sizes its static K, V by it)
        h = cfg.hidden_size
        self.fc = nn.Linear(fc_in, h, bias=False)
        self.midlayer = Eagle3Layer(target, cfg)
        self.norm = type(target.decoder.norm)(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)  # [N] offsets
        self.vocab_size = target.vocab_size
        self.set_vocab(torch.arange(draft_vocab))

    @property
    def draft_ids(self) -> torch.Tensor:
        """[N] the target ids of the draft vocabulary, in draft-id order (ascending)."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def set_vocab(self, ids: torch.Tensor) -> None:
        """The draft vocabulary: N distinct target ids (sorted here)."""
        ids = ids.to(self.d2t.device).sort().values
        if ids.shape != self.d2t.shape or ids.unique().shape != ids.shape or int(ids[-1]) >= self.vocab_size:
            raise SpecbenchError(f"a draft vocabulary must be {self.d2t.shape[0]} distinct ids below {self.vocab_size}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: the target ids in the draft vocabulary. Derived from d2t on every use, never stored: a kept copy
        went stale when a trainer's resume loaded d2t into a head built with the identity vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.d2t.device)
        mask[self.draft_ids] = True
        return mask

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Un-normed head outputs [.., H] -> draft-vocabulary logits [.., N]."""
        return self.lm_head(self.norm(h))

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] -> [.., V]: the draft logits at their target ids, -inf elsewhere (what the tree ranks)."""
        logits = self.draft_logits(h)
        if logits.shape[-1] == self.vocab_size:
            return logits  # the whole vocabulary (d2t is the identity then)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    def step(self, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, past: CacheLayerMixin,
             allowed: torch.Tensor) -> torch.Tensor:
        """Decoding: rows (emb, h) [B, Q, H] at pos [B, Q] over the cached keys of `past` (S entries) and their own,
        which are appended to it; allowed [B, 1, Q, S+Q] (bool, or additive) -> outputs [B, Q, H]."""
        q, k, v = self.midlayer.qkv(emb, h, pos)
        keys, vals = past.update(k, v)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1])
        return self.midlayer.finish(o, h)

    def ttt(self, embed: nn.Module, ids: torch.Tensor, feats: torch.Tensor, real: torch.Tensor, steps: int):
        """The training-time test: ids [B, T] (x), feats [B, n, 3H] fused-layer inputs of positions 0..n-1 (n = T-1),
        real [B, n] bool -> each step's outputs [B, n, H], one at a time (step i at position t read x[t+1+i] at
        position t+i). Attention as at decoding: step 0's keys causally (the context), steps 1..i's at the same
        position only (the chain's drafted ancestors), one softmax over both."""
        b, n = feats.shape[:2]
        dev = feats.device
        h = self.fc(feats)
        t = torch.arange(n, device=dev)
        context = (t[None, :] <= t[:, None])[None, None] & real[:, None, None, :]  # [B, 1, n, n]
        scale = self.midlayer.dh ** -0.5
        k0 = v0 = None
        drafted: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(steps):
            tok = ids.new_zeros(b, n)
            m = max(0, min(n, ids.shape[1] - 1 - i))
            tok[:, :m] = ids[:, 1 + i : 1 + i + m]
            q, k, v = self.midlayer.qkv(embed(tok), h, (t + i)[None].expand(b, -1))
            rep = q.shape[1] // k.shape[1]
            if i == 0:
                k0, v0 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, nh, n, dh]
            else:
                drafted.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
            scores = (q @ k0.transpose(-1, -2) * scale).float().masked_fill(~context, float("-inf"))  # [B, nh, n, n]
            diag = [((q * kj).sum(-1) * scale).float()[..., None] for kj, _ in drafted]  # [B, nh, n, 1] each
            p = torch.cat([scores, *diag], -1).softmax(-1).to(q.dtype)
            o = p[..., :n] @ v0
            for j, (_, vj) in enumerate(drafted):
                o = o + p[..., n + j : n + j + 1] * vj
            h = self.midlayer.finish(o, h)
            yield h


@dataclass
class Eagle3Options:
    draft_vocab: int | None = None  # N (capped at the target's vocabulary); None: sized by draft_vocab_coverage
    draft_vocab_coverage: float = 0.995  # N = the fewest ids covering this share of the training answers' tokens,
    draft_vocab_multiple: int = 1024  # rounded up to a multiple of this (the authors fix N = 32000 for Llama-3)
    layers: list[int] | None = None  # hidden_states indices fused by fc; None: the authors' (2, L//2, L-3)
    intermediate_size: int | None = None  # the head's MLP; None: the target's (the authors' configs: the target's)
    rms_norm_eps: float | None = None  # None: the target's
    rope_theta: float | None = None  # None: the target's (a published head without one: 10000, the authors' code)
    steps: int = 7  # TTT steps (the authors' `self.length = 7`)
    step_weight: float = 0.8  # step i's loss weight step_weight ** i (the authors' main.py)
    # each step's summed CE over: real = the batch's real positions; padded = every position of the padded batch (the
    # authors' `.mean()`), which weighs a batch by its share of padding (and so moves what norm clipping cuts)
    loss_norm: str = "real"

    def __post_init__(self):
        if self.loss_norm not in ("real", "padded"):
            raise SpecbenchError(f"eagle3 loss_norm={self.loss_norm!r} is not one of real, padded")


# options decoding ignores
TRAINING_ONLY = ("steps", "step_weight", "draft_vocab_coverage", "draft_vocab_multiple", "loss_norm")


def head_config(target, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float, theta: float):
    """The target's config class describing the head's one layer (what the MLP and RoPE classes read)."""
    base = target.model.config
    over = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "rms_norm_eps": eps, "num_hidden_layers": 1, "head_dim": hidden // heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
    return base.__class__.from_dict({**base.to_dict(), **over})


# ---- the authors' layout (SafeAILab/EAGLE's EAGLE-3 heads, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; SGLang's) ----
AUTHORS_KEYS = ("fc.weight", "norm.weight", "lm_head.weight")


def is_authors_layout(path: Path) -> bool:
    """An EAGLE-3 head in its authors' (or SGLang's) layout: a Llama config of one layer beside their weight file,
    with a draft vocabulary or `midlayer` tensors (EAGLE-1's heads have `layers.0`)."""
    meta = authors_config(path)
    return meta is not None and "hidden_size" in meta and (
        "draft_vocab_size" in meta or any("Eagle3" in a for a in meta.get("architectures") or []))


def load_authors_eagle3(path: Path, target) -> Eagle3Head:
    """Build the head a published config describes and load its tensors by the authors' names (fc, midlayer.*, norm,
    lm_head, d2t, t2d; an embed_tokens copy is checked against the target's table and not kept). One line per
    misfit."""
    cfg = json.loads((path / "config.json").read_text())
    base = target.model.config
    h = cfg["hidden_size"]
    if h != base.hidden_size:  # the head embeds tokens with the target's table
        raise SpecbenchError(f"checkpoint {path} is an EAGLE-3 head of width {h}; the target {target.name!r} has "
                             f"{base.hidden_size}")
    if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise SpecbenchError(f"checkpoint {path} is an EAGLE-3 head for a vocabulary of {cfg['vocab_size']}; the "
                             f"target {target.name!r} has {target.vocab_size}")
    n = int(cfg.get("draft_vocab_size") or target.vocab_size)
    # the head's fc reads three of the target's hidden states: a head for another width would be read as garbage
    width = int(cfg.get("target_hidden_size") or base.hidden_size)
    if width != base.hidden_size:
        raise SpecbenchError(f"checkpoint {path} is an EAGLE-3 head over target states of width {width} "
                             f"(target_hidden_size); the target {target.name!r} has {base.hidden_size}")
    fc_in = 3 * width
    # SGLang's eagle_config names the output of layer i (it captures the input of layer i + 1); a top-level list, as
    # vLLM reads it, names the input of layer i: our hidden_states index
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sglang and top and [i + 1 for i in sglang] != list(top):  # each engine would fuse other layers, silently
        raise SpecbenchError(f"checkpoint {path}: eagle_config's layer ids {list(sglang)} (SGLang: layer outputs) and "
                             f"the top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: layer inputs) "
                             "name different layers")
    layers = [i + 1 for i in sglang] if sglang else top
    layers = tuple(layers) if layers else default_layers(base.num_hidden_layers)
    if any(not 0 <= i < base.num_hidden_layers for i in layers):
        raise SpecbenchError(f"checkpoint {path}: EAGLE-3 layer ids {list(layers)} (as hidden_states indices) are "
                             f"outside the target {target.name!r}'s 0 .. {base.num_hidden_layers - 1}")
    # transformers' two spellings (rope_scaling, rope_parameters), with rope_type or the older type; "default" (or
    # none) is plain RoPE. The head's one layer uses plain RoPE: a scaled head would draft at the wrong rotations
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpecbenchError(f"checkpoint {path}: the head's RoPE is scaled ({rope}); this loader builds plain "
                             "RoPE and would drop it")
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    heads = cfg["num_attention_heads"]
    head_cfg = head_config(target, h, heads, cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"],
                           cfg.get("rms_norm_eps", base.rms_norm_eps), theta)
    head = Eagle3Head(target, head_cfg, layers, n, fc_in)
    state = read_state(path)
    emb = state.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb.shape) != tuple(target.decoder.embed_tokens.weight.shape):
        raise SpecbenchError(f"checkpoint {path}: embed_tokens {tuple(emb.shape)} does not match the target's "
                             f"{tuple(target.decoder.embed_tokens.weight.shape)} (another vocabulary)")
    t2d = state.pop("t2d", None)
    if "d2t" not in state:
        if n != target.vocab_size:
            raise SpecbenchError(f"checkpoint {path}: a draft vocabulary of {n} needs d2t, which it lacks")
        state["d2t"] = torch.zeros(n, dtype=torch.long)  # the whole vocabulary (the authors drop d2t/t2d then)
    state["d2t"] = state["d2t"].long()
    params = dict(head.named_parameters())
    copy_state(path, {k.removeprefix("model."): v for k, v in state.items()}, params, "an EAGLE-3 head")
    if t2d is not None and not torch.equal(t2d.bool().to(head.t2d.device), head.t2d):
        raise SpecbenchError(f"checkpoint {path}: t2d does not mark the ids d2t maps the draft vocabulary to")
    return head.to(target.device, target.dtype)


SERVING_FORMATS = ("sglang", "speculators")


def save_for_serving(head: Eagle3Head, target, out: Path, fmt: str, verifier: str, speculative_tokens: int) -> Path:
    """`head` written for a serving engine (config.json + model.safetensors in the target's dtype, ids int64, t2d
    bool):
    - sglang: the authors' own layout (fc, midlayer.*, norm, lm_head, d2t, t2d) under architecture
      LlamaForCausalLMEagle3, what SGLang / SpecForge load and vLLM's native EAGLE-3 loader reads too. Layers other
      than the default are written twice, once per reader: eagle_config's list in SGLang's convention (the output of
      layer i: our index - 1), which is all SGLang reads, and a top-level eagle_aux_hidden_state_layer_ids in vLLM's
      (the input of layer i: our index), which vLLM's model runner reads first (it ignores eagle_config's, falling
      back to its default layers).
    - speculators: vLLM's speculators format (architecture Eagle3Speculator, `layers.0.*`, a transformer_layer_config,
      eagle_aux_hidden_state_layer_ids as vLLM reads them: the input of layer i, our index; norm_before_residual false,
      which is EAGLE-3's residual on the un-normed h, where vLLM's own default is true)."""
    if fmt not in SERVING_FORMATS:
        raise SpecbenchError(f"export.format={fmt!r} is not one of {', '.join(SERVING_FORMATS)}")
    base, layer = target.model.config, head.midlayer
    h = head.fc.out_features
    dtype = str(target.dtype).removeprefix("torch.")
    llama = {"model_type": "llama", "hidden_act": getattr(base, "hidden_act", "silu"), "hidden_size": h,
             "intermediate_size": layer.mlp.down_proj.in_features, "num_attention_heads": layer.nh,
             "num_key_value_heads": layer.nkv, "head_dim": layer.dh, "num_hidden_layers": 1,
             "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
             "rope_scaling": None, "max_position_embeddings": getattr(base, "max_position_embeddings", None),
             "vocab_size": target.vocab_size, "tie_word_embeddings": False, "torch_dtype": dtype,
             "bos_token_id": getattr(base, "bos_token_id", None), "eos_token_id": getattr(base, "eos_token_id", None),
             "pad_token_id": getattr(base, "pad_token_id", None)}
    n = head.d2t.shape[0]
    default = head.layers == default_layers(base.num_hidden_layers)
    fc_in = head.fc.in_features // len(head.layers)
    state = {k: v.detach().to(target.dtype).cpu().contiguous() for k, v in head.named_parameters() if k != "d2t"}
    state["d2t"] = head.d2t.detach().long().cpu().contiguous()
    state["t2d"] = head.t2d.detach().bool().cpu().contiguous()
    if fmt == "sglang":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **llama, "draft_vocab_size": n}
        if fc_in != h:
            cfg["target_hidden_size"] = fc_in
        if not default:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.layers],
                                   "use_aux_hidden_state": True}
            cfg["eagle_aux_hidden_state_layer_ids"] = list(head.layers)
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
               "draft_vocab_size": n, "norm_before_residual": False, "target_hidden_size": None if fc_in == h else fc_in,
               "eagle_aux_hidden_state_layer_ids": list(head.layers), "torch_dtype": dtype,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy",
                                                            "speculative_tokens": speculative_tokens}],
                                      "verifier": {"name_or_path": verifier,
                                                   "architectures": list(base.architectures or [])}}}
        state = {(f"layers.0.{k.removeprefix('midlayer.')}" if k.startswith("midlayer.") else k): v
                 for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


class Eagle3Drafter(CachedRows, TrainableDrafter):
    name = "eagle3"
    needs = frozenset({LAYERS})
    Options = Eagle3Options

    def __init__(self, target, checkpoint: str | None = None, module: dict | None = None, tree: dict | None = None):
        self.head = self.load_module(target, checkpoint, module)
        self.hidden_layers = self.head.layers
        self.target, self.embed = target, target.decoder.embed_tokens
        self.policy = make_tree(**(tree or {"kind": "dynamic"}))
        self.cache: DraftCache | None = None  # the head's K, V over verified pairs, per generation (prefill_rows)
        self.pending: tuple | None = None  # (fused features [A,n,3H], next tokens [A,n], fresh)
        self.region = CompiledTree()  # model.compile: the tree's growth, compiled
        self.append_region = Region(self._append_step)  # and the step over newly verified pairs

    def save_for_serving(self, out: Path, fmt: str, verifier: str) -> Path:
        """This head for SGLang or vLLM (save_for_serving); a chain of the tree's depth for vLLM's proposer."""
        return save_for_serving(self.head, self.target, out, fmt, verifier, getattr(self.policy, "depth", 3))

    # ---- module ---------------------------------------------------------------------------------------------------
    @classmethod
    def load_published(cls, target, path: Path, options: dict) -> nn.Module | None:
        return load_authors_eagle3(path, target) if is_authors_layout(path) else None

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        return {k: v for k, v in options.items() if k not in TRAINING_ONLY}

    @classmethod
    def build_module(cls, target, opts: Eagle3Options) -> Eagle3Head:
        base = target.model.config
        heads = base.num_attention_heads
        cfg = head_config(target, base.hidden_size, heads, getattr(base, "num_key_value_heads", None) or heads,
                          opts.intermediate_size or base.intermediate_size, opts.rms_norm_eps or base.rms_norm_eps,
                          opts.rope_theta or rope_theta(target.model.config))
        layers = tuple(opts.layers) if opts.layers else default_layers(base.num_hidden_layers)
        if any(not 0 <= i < base.num_hidden_layers for i in layers):
            raise SpecbenchError(f"eagle3 layers {list(layers)}: hidden_states indices must be in 0 .. "
                                 f"{base.num_hidden_layers - 1} (the inputs of the target's layers)")
        n = min(opts.draft_vocab or target.vocab_size, target.vocab_size)  # unsized (no data): every id
        return Eagle3Head(target, cfg, layers, n, len(layers) * base.hidden_size).to(target.device)

    @classmethod
    def feature_layers(cls, module) -> tuple[int, ...]:
        return module.layers

    @classmethod
    def fit_options(cls, opts: Eagle3Options, counts: torch.Tensor) -> dict:
        """N by the YAML's rule (the fewest ids covering draft_vocab_coverage of the answer tokens, rounded up to
        draft_vocab_multiple) where draft_vocab is not given."""
        if opts.draft_vocab is not None:
            return {}
        return {"draft_vocab": covering_size(counts, opts.draft_vocab_coverage, opts.draft_vocab_multiple)}

    @classmethod
    def fit_data(cls, module, counts: torch.Tensor, opts) -> None:
        """The draft vocabulary: the N most frequent answer tokens (ties and unseen ids by id, as SpecForge pads)."""
        del opts
        module.set_vocab(frequent_ids(counts, module.d2t.shape[0]))

    # ---- training -------------------------------------------------------------------------------------------------
    @classmethod
    def training_loss(cls, module, batch, target, opts: Eagle3Options):
        """sum_i w^i CE(p_i, q_i) over the TTT steps (see the module docstring)."""
        ids = batch.input_ids
        n = ids.shape[1] - 1
        real = batch.attn_mask[:, :n].bool()
        draft_ids = module.draft_ids
        loss, parts = 0.0, {}
        denom = real.sum().clamp(min=1) if opts.loss_norm == "real" else real.numel()
        for i, h in enumerate(module.ttt(target.decoder.embed_tokens, ids, batch.layers[:, :n], real, opts.steps)):
            # step i at position t predicts x[t+2+i]; the target's law for it comes from its hidden state at t+1+i
            m = max(0, n - 1 - i)
            rows = batch.loss_mask[:, 2 + i : 2 + i + m].bool()  # [B, m] the predicted token is an answer token
            full = target.lm_head(batch.hidden[:, 1 + i : 1 + i + m][rows].to(target.dtype)).float()  # [M, V]
            keep = module.t2d[full.argmax(-1)]  # the authors' position_mask: the target's top-1 is draftable
            p = full[keep][:, draft_ids].softmax(-1)
            logq = module.draft_logits(h[:, :m][rows][keep]).float().log_softmax(-1)
            ce = -(p * logq).sum(-1).sum() / denom
            loss = loss + opts.step_weight ** i * ce
            parts[f"ce{i}"] = ce.item()
            parts[f"top{i}"] = (logq.argmax(-1) == p.argmax(-1)).float().mean().item() if p.shape[0] else 0.0
        return loss, parts

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        """`hidden` [T, 3H]: the fused layers' inputs (the trainer's validation computes them from the target)."""
        embed, out = target.decoder.embed_tokens, []
        for t in positions:
            causal = torch.ones(1, 1, t, t, dtype=torch.bool, device=hidden.device).tril()
            past = DynamicLayer()
            h = module.step(embed(input_ids[None, 1 : t + 1]), module.fc(hidden[None, :t]),
                            torch.arange(t, device=hidden.device)[None], past, causal)
            row, f = [], h[:, -1:]
            for d in range(depth):
                x = module.target_logits(f).argmax(-1)  # [1, 1] a target id
                row.append(x[0, 0])
                allowed = torch.ones(1, 1, 1, past.get_seq_length() + 1, dtype=torch.bool, device=f.device)
                f = module.step(embed(x), f, torch.tensor([[t + d]], device=f.device), past, allowed)
            out.append(torch.stack(row))
        return torch.stack(out)

    # ---- decoding -------------------------------------------------------------------------------------------------
    # Every row of a batch, batch 1 included, drafts in the same forwards (the rows protocol): the head's K, V
    # (specbench/decode/draftcache.py: one layer; model.compile: a static cache of the batch's bucket) hold each row's
    # verified pairs, then its drafted entries, behind its own length; one step per tree level for all rows.
    # model.compile: the step over the new verified pairs (`_append_step`) and the tree (CompiledTree) are compiled
    # regions of the same code.
    def prefill_rows(self, state: TargetState) -> None:
        self.cache = DraftCache.for_decoder(self.target, self.head.config, state, self.head.midlayer)
        # pairs (features_i, t_{i+1}), i = 0 .. L-1: row b's first fresh[b]
        self.pending = (state.layers, state.fresh_tokens(), state.fresh)

    @property
    def past(self) -> CacheLayerMixin:
        """The head's K, V layer."""
        return self.cache.cache.layers[0]

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        feats, toks, fresh = self.pending
        h = self.cache.append(self._append_step, fresh, toks, feats, region=self.append_region)  # [A, n, H]
        root_h = fresh.last(h)  # [A, H]
        return self.cache.grow(self._grow, root_h, self.region, self.policy, self.head.vocab_size)

    def _append_step(self, prefixes: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """ids [P, Q], fused features [P, Q, 3H] behind each row's `prefixes` [P] verified pairs, causal among
        themselves -> the head's outputs [P, Q, H] (their K, V written into `past`)."""
        dtype = self.head.fc.weight.dtype
        pos, mask = self.cache.causal(prefixes, ids.shape[1], dtype)
        return self.head.step(self.embed(ids), self.head.fc(feats.to(dtype)), pos, self.past, mask)

    def _grow(self, root_h: torch.Tensor, at, laid_out: bool) -> Grown:
        """The tree policy grown from the root's output [A, H]; each level one step of the head over `past`, at the
        positions and mask `at(seen [A, m, S], depth, dtype)` gives (laid_out: inside CompiledTree's region, which
        also sets the static cache's write offsets; the head writes through `past` either way)."""
        del laid_out

        def step(tokens: torch.Tensor, h_in: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            # a node's token and its parent's output; the level's K, V appended behind the verified pairs and the
            # earlier levels
            return self.head.step(self.embed(tokens), h_in, pos, self.past, mask)

        return grow_by_features(self.policy, root_h, at, self.head.fc.weight.dtype, step, self.head.target_logits)

    def on_verified_rows(self, state: TargetState) -> None:
        # root + accepted path: pairs (features_T, t_{T+1}) ... (features_{T+A}, ...)
        self.pending = (state.layers, state.fresh_tokens(), state.fresh)
