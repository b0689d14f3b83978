"""MoA, Mixture of Attentions (Zimmer et al., papers/002 Sec. 3, App. A.1, A.3), as its authors' code builds it
(huawei-noah/HEBO, branch mixture-of-attentions: moa_spec/models/{train,inference}/moa_spec.py, cross_attention.py).

Information flow (Fig. 1, Algorithm 1):
  Layer Self-Attention (LSA): per verified token, the target's per-layer K/V rows [L, 2 E_kv] (per KV head [K_h|V_h],
    heads side by side: the authors' `cat(kv, -1).permute(0, 2, 1, 3)`) go through a stock decoder layer of the
    target's family at width 2 E_kv: input and post-attention RMSNorms, RoPE over the layer index, bidirectional
    attention across the L layers, a gated MLP. Then the mean over layers and `Ekv2E` (Linear 2 E_kv -> E, biased).
    Computed once per drafting cycle for the newly verified tokens only (their activations do not change afterwards).
  Self-Attention (SA): a stock decoder layer at width E (its own K/V head count and MLP) over the token embeddings of
    the prompt, verified and drafted tokens (tree mask while drafting) -> the draft queries.
  Cross-Attention (CA): the authors' LlamaDecoderLayerCrossAttention: one input RMSNorm applied to the queries (SA
    outputs) and to the keys (Ekv2E outputs) alike, q/k/v/o projections without bias, RoPE at each side's positions,
    the post-attention RMSNorm and a gated MLP; queries see the activations of verified tokens only -> o^.
  Target Layer Inference (TLI, Sec. 3.2): for TLI > 0 the last TLI target layers (frozen, shared) run on o^ with the
    target's cached K/V of verified tokens plus the drafter's own K/V of the drafted path, then the final norm and
    LM head; TLI = 0 feeds o^ to the LM head directly.
Parameter names are the authors' (`layer_self_attention.*`, `Ekv2E.*`, `self_attention.*`, `cross_attention.*`), so
their published checkpoint (huawei-noah/MOASpec-Llama-3-8B-Instruct) loads as it is, in their training's layout or in
their vLLM port's: `load_authors_moa` reads every width and head count from its tensors (the LSA's query heads by the
authors' rule, the target's head count) and checks the widths a vLLM-layout config.json records against them.

Training (the authors' moa_spec.py forward and trainer):
  - blocks: per sequence `every` ~ randint(6, 15) (6..14); positions i with i % every == 0, and every non-answer
    position, are block starts; a query sees target activations up to the last block start at or before it
    (start(i) <= i: a block-start query sees its own, and is trained like every answer position);
  - the SA "staircase" curriculum: a sequence's SA sees only its own block (and itself) with probability
    1 - progress / 0.5, else it is causal (the authors' epoch / (max_epochs / 2) over their 40 epochs, here the
    fraction of the budget's steps: our 2 epochs would make it a step; `staircase_stairs: 2` trains that step);
  - loss (Table 6, Eq. 2): 0.1 x CE to the target's next-token law (the authors' "forward_KL", -sum p log q) +
    SmoothL1 of the final feature (the LM head's input) to the target's last hidden state; with TLI > 0 the feature
    term is 0.5 x that + 0.5 x SmoothL1 of o^ to the input of the first TLI layer; over every answer position (the
    pre-TLI term is 0 at block starts, which count in its mean: theirs overwrites the prediction there in place,
    and so do we for the TLI layers' input: at a block start they take the true input, so with `tli_training:
    drafting` (the default) the final loss there trains nothing of the drafter; with `causal` it does, through the
    TLI layers' attention to the earlier positions' predicted inputs);
  - gradients clipped to norm 1.0, AdamW without weight decay (their trainer.yaml; conf/drafter/moa.yaml);
  - init as theirs: Linear weights and RMSNorm weights ~ N(0, initializer_range), biases 0 (HF's `_init_weights` of
    their class, which they extended to the RMSNorms).
Where we differ, and why:
  - TLI during training: the TLI layers see the true K/V up to the block start and the block's own predicted
    positions, which is what drafting sees (the training prediction equals the decoding path, tests/test_moa.py).
    The authors run them causally over the predicted inputs of every earlier position (true at block starts only;
    their comment: "assume errors because fully on-policy needs multiple forward pass"): our features hold the true
    K/V of every layer, so the on-policy mask costs nothing here. `tli_training: causal` trains theirs.
  - lr schedule: the budget's (warm-up, cosine) as every method's; theirs warms up to 20 x lr and decays to lr over
    one epoch, then stays there.
  - block lengths: their code's randint(6, 15), 6..14 (Table 6: U{5..15});
  - widths: their code's ratios to Llama-3-8B (WIDTHS["code"], the default; Table 6's differ in five of six and
    are `widths: table6`; which set their published checkpoint holds is not known here, docs/drafters.md), scaled to the target with K/V heads rounded to a divisor of the query heads. Their rule
    for the LSA (the target's 9 query heads at width 2 E_kv = 384) gives a head size of 42.7 on SmolLM2; we take
    heads of 64, the head size of their own Llama-3-8B instance (2048 / 32): 6.
  - TLI while drafting (tli_context): the paper's Algorithm 1 (the TLI layers attend to the target's cached K/V of
    verified tokens and the drafted path's) by default; their inference code runs the TLI layers without any cache
    (`use_cache=False`), and `tli_context: none` runs them so: a drafted row sees only itself. In theirs every row of
    a level sees all of its level's rows, both ways (moa_spec.py passes the tree mask [b, N + (g-1) b], which
    transformers < 4.46 cut to the b keys: its first N columns, the verified prefix's, all open); ours does not. Not
    measured: as published their TLI does not run past the root step (there the mask cut to one key, [P+1, 1], does not
    broadcast against the one query in SDPA), and their shipped configs set TLI to 0. `none` against `target`, measured
    (make bench EXPERIMENT=moa_tli_context, docs/results.md): the six sets' mean tau 1.50 either way.
    Training is the paper's either way (see the first item).
  - loss weighting: the mean over every answer token of the budget's batch of 2 (longer answers weigh more); theirs
    is one sequence per micro-batch (`mini_batch_size: 1`, 32 accumulated), each sequence weighing the same.
  - target layers: the TLI layers run the target's own weights through a functional restatement of the Llama decoder
    layer (drafters/layers.py: target_layer), because the drafter may not touch the target's cache.
Decoding (every batch size, 1 included, one path): one DraftCache (specbench/decode/draftcache.py) over the SA, TLI
and CA layers; per step one forward appends the newly verified tokens' activations and SA entries, then the tree grows
level by level. model.compile: those two steps as two compiled regions on a static cache, drafting the eager trees.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Cache

from specbench.decode.checkpoints import authors_config, check_authors_config, copy_state, read_state, rope_theta
from specbench.decode.compiled import Region
from specbench.decode.draftcache import CachedRows, CompiledTree, DraftCache
from specbench.decode.drafter import KV, TrainableDrafter, chain_paths
from specbench.errors import SpecbenchError
from drafters.distill import per_sequence_weights, teacher_probs, top1, weighted_mean
from drafters.layers import CrossAttend, dims, layers_config, target_layer
from drafters.trees import Grown, GrowingTree, chain_alone, make_tree
from specbench.decode.target import cache_kv, kv_per_token
from specbench.decode.tree import additive, batch_tree_mask
from specbench.decode.types import DraftTree, TargetState
from specbench.decode.verifier import Crossing


def _sub_config(target, plain_rope: bool, **overrides):
    """The target's config with `overrides` (a layer of another width or head count), sdpa attention. plain_rope:
    RoPE without the target's scaling, at its base (the authors' CA resets rope_scaling on the config it shares with
    the LSA, built after it)."""
    base = target.model.config
    d = base.to_dict()
    if plain_rope:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta(base)}
        d["rope_scaling"] = None
    cfg = base.__class__.from_dict({**d, **overrides})
    cfg._attn_implementation = "sdpa"
    return cfg


class _Projections(nn.Module):
    """q/k/v/o of the authors' LlamaCrossAttention (named `self_attn`, as in their checkpoint)."""

    def __init__(self, e: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(e, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(e, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(e, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, e, bias=False)


class CrossAttention(CrossAttend):
    """The authors' CA layer, Beagle's cross-attention (drafters/layers.py CrossAttend) in their names: one input
    RMSNorm for queries and keys, projections from E without bias. Queries [B, Q, E], activations [B, K, E]."""

    # CrossAttend's parts, under the authors' names (their checkpoint's)
    q_proj, k_proj, v_proj, o_proj = (property(lambda self, n=n: getattr(self.self_attn, n))
                                      for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    q_norm = kv_norm = property(lambda self: self.input_layernorm)
    post_norm = property(lambda self: self.post_attention_layernorm)

    def __init__(self, target, cfg):
        super().__init__()
        e, nh, nkv, dh = dims(cfg)
        self.nh, self.nkv, self.dh = nh, nkv, dh
        norm = type(target.decoder.norm)
        self.self_attn = _Projections(e, nh, nkv, dh)
        self.mlp = type(target.decoder.layers[0].mlp)(cfg)
        self.input_layernorm, self.post_attention_layernorm = norm(e, eps=cfg.rms_norm_eps), norm(e, eps=cfg.rms_norm_eps)
        self.rotary = type(target.decoder.rotary_emb)(config=cfg)


# The widths as ratios to the target, two sets (drafter.module.widths). Query heads are always the target's (SA, CA)
# and 2 E_kv / lsa_head_dim (LSA); K/V heads are a fraction of the layer's query heads (rounded to the nearest
# divisor, ties up, at least 1) or the target's own K/V heads ("target"); MLPs a multiple of the layer's width.
#   code:   the authors' configs/training/method/moa_spec.yaml (and their inference yaml), on Llama-3-8B
#           (E 4096, 32 heads, E_kv 1024): SA K/V 4 of 32 heads, MLP 6144; CA K/V 4 of 32, MLP 6144; LSA (2048 wide,
#           32 heads of 64) K/V 8 of 32, MLP 3072. What their README's training command trains.
#   table6: papers/002 Table 6: SA K/V 512 (1/8 of E), MLP 512 (E/8); CA K/V 1024 (Llama-3-8B's own 8 K/V heads),
#           MLP 7168 (1.75 E); LSA K/V 1024 of 2048 (half), MLP 6144 (3x).
WIDTHS = {
    "code": {"sa_kv": 1 / 8, "sa_mlp": 1.5, "ca_kv": 1 / 8, "ca_mlp": 1.5, "lsa_kv": 1 / 4, "lsa_mlp": 1.5},
    "table6": {"sa_kv": 1 / 8, "sa_mlp": 1 / 8, "ca_kv": "target", "ca_mlp": 1.75, "lsa_kv": 1 / 2, "lsa_mlp": 3.0},
}
TLI_CONTEXT = ("target", "none")


def kv_heads(heads: int, fraction: float) -> int:
    """The divisor of `heads` nearest heads x fraction (ties: the larger), at least 1."""
    want = heads * fraction
    return min((d for d in range(1, heads + 1) if heads % d == 0), key=lambda d: (abs(d - want), -d))


@dataclass
class MoAOptions:
    tli: int = 0  # target layers run after the drafter (0: the drafter predicts the last hidden state)
    widths: str = "code"  # the width set the unset widths below come from (WIDTHS): code | table6
    lsa_head_dim: int | None = None  # LSA head size (None: 2 E_kv / the target's query heads, the authors' rule)
    lsa_kv_heads: int | None = None  # None: from `widths`
    lsa_mlp: int | None = None
    sa_kv_heads: int | None = None
    sa_mlp: int | None = None
    ca_kv_heads: int | None = None
    ca_mlp: int | None = None
    # drafting: what the TLI layers attend to besides the drafted row itself. target: the target's cached K/V of
    # verified tokens and the drafted path's (papers/002 Sec. 3.2, Algorithm 1); none: nothing (the authors'
    # inference code runs them without a cache, use_cache=False, on one level's rows; each row alone here)
    tli_context: str = "target"
    # training, TLI > 0: what the TLI layers attend to. drafting: what they see while drafting (the target's true K/V
    # up to the block start, then the block's predicted positions); causal: the authors' training (moa_spec.py), one
    # causal pass over the TLI input, predicted everywhere but block starts ("assume errors because fully on-policy
    # needs multiple forward pass")
    tli_training: str = "drafting"
    # training (the authors' moa_spec.py): block lengths ~ randint(block_min, block_max + 1) per sequence
    block_min: int = 6
    block_max: int = 14
    staircase: bool = True  # the SA curriculum (their `staircase_mask: True`)
    staircase_until: float = 0.5  # the fraction of the budget by which it has faded out (their max_epochs / 2)
    # 0: it fades with every step; N: in N equal stairs (theirs: one per epoch, epoch / (max_epochs / 2); on the
    # budget's 2 epochs, N = 2 is a whole epoch with it, then none)
    staircase_stairs: int = 0
    tli_final_weight: float = 0.5  # TLI > 0: this x the final-feature loss + (1 - this) x the pre-TLI one
    # token: the mean over every answer position of the batch (longer answers weigh more; the budget's, every
    # method's); sequence: the mean of each sequence's mean (the authors' one sequence per micro-batch)
    loss_weighting: str = "token"

    def __post_init__(self):
        if self.loss_weighting not in ("token", "sequence"):
            raise SpecbenchError(f"moa loss_weighting={self.loss_weighting!r} is not one of token, sequence")
        if self.tli_training not in ("drafting", "causal"):
            raise SpecbenchError(f"moa tli_training={self.tli_training!r} is not one of drafting, causal")
        if self.staircase_stairs < 0:
            raise SpecbenchError(f"moa staircase_stairs={self.staircase_stairs} must be 0 (a smooth fade) or more stairs")


def resolve_widths(opts: MoAOptions, e: int, nh: int, nkv: int, lsa_width: int, lsa_heads: int) -> dict[str, int]:
    """Every K/V head count and MLP width: the option where set, else the `widths` set's ratio for this target."""
    if opts.widths not in WIDTHS:
        raise ValueError(f"moa widths={opts.widths!r} is not one of {', '.join(WIDTHS)}")
    r = WIDTHS[opts.widths]
    derived = {"sa_kv_heads": kv_heads(nh, r["sa_kv"]), "sa_mlp": round(r["sa_mlp"] * e),
               "ca_kv_heads": nkv if r["ca_kv"] == "target" else kv_heads(nh, r["ca_kv"]),
               "ca_mlp": round(r["ca_mlp"] * e),
               "lsa_kv_heads": kv_heads(lsa_heads, r["lsa_kv"]), "lsa_mlp": round(r["lsa_mlp"] * lsa_width)}
    return {k: getattr(opts, k) if getattr(opts, k) is not None else v for k, v in derived.items()}


class MoAModule(nn.Module):
    """The authors' MOASpec drafter weights: `layer_self_attention`, `Ekv2E`, `self_attention`, `cross_attention`."""

    def __init__(self, target, opts: MoAOptions):
        super().__init__()
        cfg = target.model.config
        e, nh, nkv, dh = dims(cfg)
        self.tli, self.layers, self.kv_dim = opts.tli, cfg.num_hidden_layers, 2 * nkv * dh
        head_dim = opts.lsa_head_dim or self.kv_dim // nh
        heads = max(1, self.kv_dim // head_dim)  # (one head of the whole width where it is narrower than a head)
        if self.kv_dim % heads:
            raise ValueError(f"the LSA width 2 E_kv = {self.kv_dim} does not split into heads of "
                             f"lsa_head_dim={head_dim}: set drafter.module.lsa_head_dim")
        w = resolve_widths(opts, e, nh, nkv, self.kv_dim, heads)
        layer = type(target.decoder.layers[0])
        sa_cfg = _sub_config(target, False, num_key_value_heads=w["sa_kv_heads"], intermediate_size=w["sa_mlp"])
        self.self_attention = layer(sa_cfg, 0)
        self.sa_rotary = type(target.decoder.rotary_emb)(config=sa_cfg)
        ca_cfg = _sub_config(target, True, num_key_value_heads=w["ca_kv_heads"], intermediate_size=w["ca_mlp"],
                             attention_bias=False, mlp_bias=False)
        self.cross_attention = CrossAttention(target, ca_cfg)
        lsa_cfg = _sub_config(target, True, hidden_size=self.kv_dim, num_attention_heads=heads,
                              head_dim=self.kv_dim // heads, num_key_value_heads=w["lsa_kv_heads"],
                              intermediate_size=w["lsa_mlp"])
        self.layer_self_attention = layer(lsa_cfg, 0)
        self.lsa_rotary = type(target.decoder.rotary_emb)(config=lsa_cfg)
        self.Ekv2E = nn.Linear(self.kv_dim, e)
        self._authors_init(cfg.initializer_range)

    def _authors_init(self, std: float) -> None:
        """Their `_init_weights`: Linear and RMSNorm weights ~ N(0, std), biases 0."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)
                    if m.bias is not None:
                        m.bias.zero_()
                elif type(m).__name__.endswith("RMSNorm"):
                    m.weight.normal_(0.0, std)

    def lsa(self, per_layer: torch.Tensor) -> torch.Tensor:
        """[N, L, 2 E_kv] per-token stacks of per-layer K/V -> [N, E]: `lsa_mean`, then Ekv2E."""
        return self.Ekv2E(self.lsa_mean(per_layer))

    def lsa_mean(self, per_layer: torch.Tensor) -> torch.Tensor:
        """[N, L, 2 E_kv] -> [N, 2 E_kv]: the LSA layer over the layers (RoPE at the layer index, every layer sees
        every other), their mean (what a split's server sends; `lsa` applies Ekv2E)."""
        n, l, _ = per_layer.shape
        pos = torch.arange(l, device=per_layer.device)[None]
        both = torch.zeros(1, 1, l, l, dtype=per_layer.dtype, device=per_layer.device)  # additive: all visible
        x = self.layer_self_attention(per_layer, attention_mask=both, position_ids=pos,
                                      position_embeddings=self.lsa_rotary(per_layer, pos))
        return x.mean(1)

    def sa(self, emb: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
           cache: Cache | None = None) -> torch.Tensor:
        """SA layer: emb [B, Q, E] at pos [B, Q], additive mask [B|1, 1, Q, K] -> [B, Q, E] (appended to `cache`)."""
        return self.self_attention(emb, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                   use_cache=cache is not None, position_embeddings=self.sa_rotary(emb, pos))


def block_starts(loss_mask: torch.Tensor, every: torch.Tensor) -> torch.Tensor:
    """start(i) for every position: the last block start at or before i, where block starts are the non-answer
    positions and the answer positions i with i % every == 0 (the authors' `response_mask_noisy == 0`, cummax).
    loss_mask [B, T], every [B] -> [B, T]."""
    idx = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    brk = (loss_mask == 0) | (idx[None] % every[:, None] == 0)
    return torch.cummax(torch.where(brk, idx[None], 0), dim=1).values


def staircase_rows(batch_size: int, progress: float, until: float, device, stairs: int = 0) -> torch.Tensor:
    """Which sequences' SA sees only its own block: each with probability 1 - progress / until (0 once faded).
    stairs N > 0: progress taken at the start of its N-th of the budget (the authors' fade by epoch, N = epochs)."""
    if stairs > 0:
        progress = math.floor(progress * stairs + 1e-9) / stairs
    p = min(1.0, progress / until) if until > 0 else 1.0
    return ~(torch.rand(batch_size, device=device) < p)


class MoADrafter(CachedRows, TrainableDrafter):
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
        self.target, self.embed, self.lm_head = target, target.decoder.embed_tokens, target.lm_head
        self.final_norm, self.rotary = target.decoder.norm, target.decoder.rotary_emb
        self.tli_layers = list(target.decoder.layers[len(target.decoder.layers) - self.net.tli :])  # frozen, shared
        # read from the run's options (a checkpoint records its training's; this one is the run's to choose)
        self.tli_context = (module or {}).get("tli_context", "target")
        if self.tli_context not in TLI_CONTEXT:
            raise SpecbenchError(f"moa tli_context={self.tli_context!r} is not one of {', '.join(TLI_CONTEXT)}")
        self.cache: DraftCache | None = None  # per generation (prefill_rows): the SA, TLI and CA layers' K, V
        self.region = CompiledTree()  # model.compile: the tree's growth, compiled
        self.append_region = Region(self._append_step)  # and the step over the new verified tokens

    # ---- weights -------------------------------------------------------------------------------------------------
    @classmethod
    def build_module(cls, target, opts: MoAOptions) -> MoAModule:
        if not 0 <= opts.tli < target.model.config.num_hidden_layers:
            raise ValueError(f"tli={opts.tli} must be in [0, {target.model.config.num_hidden_layers})")
        return MoAModule(target, opts).to(target.device)

    # options the module's shape ignores: training's
    TRAINING_ONLY = ("block_min", "block_max", "staircase", "staircase_until", "staircase_stairs", "tli_final_weight",
                     "loss_weighting", "tli_training")

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        """The options decoding depends on: the shaping ones, and drafting's tli_context where it is not the default
        `target` (it shapes nothing, but a run drafting with `none` must be named apart from one with `target`: the
        run key reads these; runs recorded before the option keep their names). Options recorded before `widths`
        existed (checkpoints and runs before 2026-11-27) were derived by Table 6's ratios, so they rebuild at those."""
        opts = {"widths": "table6", **{k: v for k, v in options.items() if k not in cls.TRAINING_ONLY}}
        if opts.get("tli_context", "target") == "target":
            opts.pop("tli_context", None)
        return opts

    @classmethod
    def load_published(cls, target, path: Path, options: dict) -> nn.Module | None:
        """The authors' layout: a target config.json beside `Ekv2E.*`; TLI, which it does not record, from the YAML."""
        return load_authors_moa(path, target, int(options.get("tli", 0))) if is_authors_layout(path) else None

    # ---- training side -------------------------------------------------------------------------------------------
    @staticmethod
    def _layer_kv(kv: torch.Tensor, layer: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [B, T, L, nkv * 2dh] ([K_h|V_h] per head) -> the layer's (K, V) [B, nkv, T, dh]."""
        b, t = kv.shape[:2]
        k, v = kv[:, :, layer].reshape(b, t, nkv, -1).chunk(2, -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    @classmethod
    def predict(cls, net, target, ids, kv, pre_pad, starts, staircase: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, tli_input: torch.Tensor | None = None, tli_causal: bool = False):
        """Teacher-forced prediction: ids [B, T], kv [B, T, L, 2E_kv], pre_pad [B, T] (1 = real), starts [B, T] =
        start(i), staircase [B] bool (SA within the block) -> (o^ [B, T, E], the LM head's input [B, T, E], logits);
        with `rows` [B, T] bool the 49k-row LM head and the outputs are taken there only ([M, ...]). With TLI > 0 and
        `tli_input` [B, T, E] (the target's true input of the first TLI layer), the TLI layers take it, not o^, at
        block starts, as the authors' forward overwrites it there: without `tli_causal` the final loss at a block start
        (a query never drafted) then trains nothing of the drafter, and its prediction is the target's own; with it,
        that query attends to the earlier positions' predicted inputs, which its loss trains. `tli_causal`: the TLI
        layers take their K/V from their own input at every position, causally (the authors' training), not the
        target's true K/V up to start(i)."""
        b, t = ids.shape
        dev = ids.device
        idx = torch.arange(t, device=dev)
        pos = idx[None].expand(b, -1)
        real = pre_pad.bool()
        causal = (idx[None, :] <= idx[:, None])[None] & real[:, None, :]  # [B, T, T]
        ca_allowed = (idx[None, None, :] <= starts[:, :, None]) & real[:, None, :]  # activations up to start(i)
        own = (idx[None, None, :] > starts[:, :, None]) & causal  # the block's own positions, up to itself
        sa_allowed = causal
        if staircase is not None:
            sa_allowed = torch.where(staircase[:, None, None], own | torch.eye(t, dtype=torch.bool, device=dev), causal)
        wdt = net.Ekv2E.weight.dtype
        acts = net.lsa(kv.reshape(b * t, net.layers, -1).to(wdt)).view(b, t, -1)
        emb = target.decoder.embed_tokens(ids).to(wdt)
        q = net.sa(emb, pos, additive(sa_allowed[:, None], wdt))
        out = net.cross_attention(q, pos, ca_allowed[:, None], net.cross_attention.keys(acts, pos))
        x = out
        if net.tli:
            if tli_input is not None:  # [B, T, E]: true at block starts (start(i) == i), o^ elsewhere
                x = torch.where((starts == idx[None])[..., None], tli_input.to(out.dtype), out)
            nkv = target.decoder.layers[0].self_attn.k_proj.out_features // target.decoder.layers[0].self_attn.head_dim
            first = len(target.decoder.layers) - net.tli
            if tli_causal:  # no past K/V: every key is the layer's own input's (predicted but at block starts)
                allowed = causal[:, None]
            else:  # the target's true K/V up to start(i), the layer's own (predicted) keys after it
                allowed = torch.cat([ca_allowed, own], -1)[:, None]
            for i, layer in enumerate(target.decoder.layers[first:]):
                if tli_causal:
                    k = v = x.new_zeros(b, nkv, 0, layer.self_attn.head_dim)  # [B, kv_heads, 0, head_dim]
                else:
                    k, v = cls._layer_kv(kv, first + i, nkv)
                x, _, _ = target_layer(layer, target.decoder.rotary_emb, x, pos, k, v, allowed)
            x = target.decoder.norm(x)
        if rows is not None:
            out, x = out[rows], x[rows]
        return out, x, target.lm_head(x.to(target.dtype)).float()

    @classmethod
    def training_steps(cls, module, batch, target, opts: MoAOptions, epoch: int, progress: float = 0.0):
        del epoch
        b = batch.input_ids.shape[0]
        dev = batch.input_ids.device
        every = torch.randint(opts.block_min, opts.block_max + 1, (b,), device=dev)
        starts = block_starts(batch.loss_mask * batch.attn_mask, every)
        stair = (staircase_rows(b, progress, opts.staircase_until, dev, opts.staircase_stairs) if opts.staircase
                 else None)
        rows = (batch.loss_mask * batch.attn_mask).bool()  # every answer position (the authors' response_mask)
        true_in = batch.pre[:, :, module.tli - 1] if module.tli else None  # [B, T, E] the first TLI layer's input
        out, final, logits = cls.predict(module, target, batch.input_ids, batch.kv, batch.attn_mask, starts, stair,
                                         rows, true_in, opts.tli_training == "causal")
        p = teacher_probs(target, batch.hidden[rows])  # [M, V]
        logq = logits.log_softmax(-1)
        w = per_sequence_weights(rows) if opts.loss_weighting == "sequence" else None  # [M] or None: a plain mean
        ce = weighted_mean(-(p * logq).sum(-1), w)  # -sum_v p log q per position (distill.soft_ce, unreduced)
        feat = weighted_mean(F.smooth_l1_loss(final, batch.hidden[rows].to(final.dtype), reduction="none").mean(-1), w)
        parts = {"ce": ce.item(), "feat": feat.item(), "top1": top1(logq, p)}
        if module.tli:
            pre = true_in[rows]
            # zero at block starts, which still count in the mean (the authors overwrite the TLI input there with the
            # true one in place, so their prediction equals its target: moa_spec.py's prev_feature_loss)
            inside = (starts != torch.arange(starts.shape[1], device=dev))[rows]
            prev = weighted_mean(F.smooth_l1_loss(out, pre.to(out.dtype), reduction="none").mean(-1) * inside, w)
            feat = opts.tli_final_weight * feat + (1 - opts.tli_final_weight) * prev
            parts["prev_feat"] = prev.item()
        if stair is not None:
            parts["staircase"] = stair.float().mean().item()
        yield cls.lambda_kl * ce + cls.lambda_reg * feat, parts

    @classmethod
    def training_loss(cls, module, batch, target, opts: MoAOptions):
        """The loss at the end of the curriculum (no staircase), for tests and tools."""
        return next(cls.training_steps(module, batch, target, opts, epoch=0, progress=1.0))

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        """Greedy chains through the decoding path itself (the target's K/V recomputed for the prefix): a static tree
        of one path, each drafted token seeing the same activations and its drafted ancestors."""
        d = cls(target, net=module, tree={"kind": "static", "paths": chain_paths(depth)})
        out = []
        for t in positions:
            cache = target.new_cache()
            target.forward(input_ids[None, :t], cache, logits_rows=slice(0, 0))
            state = TargetState(tokens=input_ids[None, : t + 1], hidden=None, kv=cache_kv(cache, target.device))
            d.prefill_rows(state)
            out.append(d.propose_rows(state).tokens[0])
        return torch.stack(out)

    # ---- decoding side -------------------------------------------------------------------------------------------
    # Every row of a batch, batch 1 included, drafts in the same forwards. One DraftCache holds the layers [SA, TLI...,
    # CA]; a row's verified entries are the target's cached tokens' (every verified token but the root). A step
    # appends the new ones (`_append_step`), then grows the tree (`_grow`), whose slot 0 is the root: a drafted entry,
    # dropped with the tree and written again as verified at the next step. model.compile: each one compiled region.
    def prefill_rows(self, state: TargetState) -> None:
        config = layers_config(self.target, 2 + self.net.tli)
        self.cache = DraftCache.for_decoder(self.target, config, state, self.net.self_attention)

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        fresh, toks = self.cache.unseen(state, behind=1)  # the target's cached entries not yet in ours (not the root)
        if fresh.max() > 0 and self.crossed:  # split: the server's LSA outputs and TLI K, V (crossing)
            self.cache.append(self._append_crossed, fresh, toks, state.hidden)
        elif fresh.max() > 0:
            # (the target's K, V: its static buffers whole under model.compile, shapes that never change)
            self.cache.append(self._append_step, fresh, toks, region=self.append_region,
                              whole=(state.kv_static or state.kv,))
        root = state.lengths.last(state.tokens)[:, None]  # [A, 1]
        vocab = self.lm_head.weight.shape[0]
        # the tree's drafted entries in the SA and TLI layers: the root's and one per node fed to `expand`
        return self.cache.grow(self._grow, root, self.region, self.policy, vocab, 1 + self.policy.expanded(vocab))

    def _append_step(self, prefixes: torch.Tensor, toks: torch.Tensor,
                     kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The verified tokens toks [P, q] behind each row's `prefixes` [P] (a row's padding past its own: stale), from
        the target's K, V of their positions (kv: per layer [P' >= P or fewer, nkv, >= prefixes + q, dh], the cache's
        views or its static buffers whole): their activations (LSA), CA keys and TLI layers' K, V, and their SA
        entries, causal among themselves."""
        (p, q), wdt = toks.shape, self.net.Ekv2E.weight.dtype
        pos, mask = self.cache.causal(prefixes, q, wdt)  # [P, q] the positions, the SA's mask
        at = pos.clamp(max=kv[0][0].shape[2] - 1)[:, None, :, None]

        def take(x: torch.Tensor) -> torch.Tensor:  # [P', nkv, cap, dh] -> [P, nkv, q, dh]
            if x.shape[0] < p:  # (the target's bucket smaller than ours: its missing rows are padding)
                x = torch.cat([x, x.new_zeros(p - x.shape[0], *x.shape[1:])])
            return x[:p].gather(2, at.expand(-1, x.shape[1], -1, x.shape[3]))

        new = [(take(k), take(v)) for k, v in kv]
        per_layer = torch.stack([kv_per_token(k, v) for k, v in new], 2)  # [P, q, L, 2E_kv]
        acts = self.net.lsa(per_layer.flatten(0, 1).to(wdt)).view(p, q, -1)  # [P, q, E]
        self.cache.cache.layers[-1].write(*self.net.cross_attention.keys(acts, pos))
        for cached, (k, v) in zip(self.cache.cache.layers[1:-1], new[len(new) - self.net.tli :]):  # (TLI layers)
            cached.write(k, v)
        self.net.sa(self.embed(toks).to(wdt), pos, mask, self.cache.cache)

    def _grow(self, root: torch.Tensor, at, laid_out: bool) -> Grown:
        """The trees from the root tokens [P, 1]: every level (the root the first, in slot 0, at `at`'s depth 1) runs
        SA and the TLI layers over the same slots and mask, CA over every verified activation (laid_out: inside
        CompiledTree's region, which sets the write offsets; the layers write through the cache either way)."""
        del laid_out
        p, dev, wdt = root.shape[0], root.device, self.net.Ekv2E.weight.dtype
        book = GrowingTree(self.policy.max_nodes, dev, root_slot=True, trees=p)
        seen = torch.ones(p, 1, 1, dtype=torch.bool, device=dev)  # the root sees its own slot
        prefixes = at(seen, 1, wdt)[0][:, 0]  # [P] each row's verified entries (the root's position)
        ca = self.cache.cache.layers[-1]
        ca_kv = ca.window_kv() if self.cache.static else (ca.keys, ca.values)
        ca_mask = batch_tree_mask(seen[:, :, :0], prefixes, ca_kv[0].shape[2], wdt)  # [P, 1, 1, W]: every activation

        def rows(tokens: torch.Tensor, seen_: torch.Tensor, depth: int) -> torch.Tensor:
            """tokens [P, R] at their depth, seeing seen_ [P, R, S] of the drafted slots -> logits [P, R, V]."""
            pos, mask = at(seen_, depth, wdt)
            x = self.net.cross_attention(self.net.sa(self.embed(tokens).to(wdt), pos, mask, self.cache.cache), pos,
                                         ca_mask, ca_kv)
            dt = self.target.dtype  # (the TLI layers' K, V are the target's)
            tli_mask = mask if mask.dtype == dt or not self.net.tli else at(seen_, depth, dt)[1]  # SA's slots
            for cached, layer in zip(self.cache.cache.layers[1:-1], self.tli_layers):
                if self.tli_context == "target":  # over the verified activations' K, V and the drafted path's
                    x, _, _ = target_layer(layer, self.rotary, x.to(dt), pos, None, None, tli_mask, into=cached)
                else:  # none, the authors' inference: no cache, each row seeing only itself (theirs: its whole level)
                    attn, r = layer.self_attn, x.shape[1]
                    past = x.new_zeros(p, attn.k_proj.out_features // attn.head_dim, 0, attn.head_dim, dtype=dt)
                    itself = torch.eye(r, dtype=torch.bool, device=dev)[None, None]  # [1, 1, R, R]
                    x, _, _ = target_layer(layer, self.rotary, x.to(dt), pos, past, past, itself)
            x = self.final_norm(x) if self.net.tli else x
            return self.lm_head(x.to(self.lm_head.weight.dtype))

        root_logits = rows(root, seen, 1)[:, 0]
        return self.policy.grow_rows(
            root_logits, lambda level: rows(level.tokens, book.add(level.nodes, level.parents), level.depth + 1))

    def on_verified_rows(self, state: TargetState) -> None:
        pass  # everything the next step needs is read from state.kv / state.tokens in propose_rows

    # ---- client-server split (specbench/deploy, issue 78; docs/deploy.md) ------------------------------------------
    # Our choice of the split point (the paper leaves it open; Table 7's 2 E_kv (TLI + 1) per token fixes it): the
    # Layer Self-Attention runs on the server (which loads this drafter's LSA weights), over the target's per-layer
    # K/V of each verified token, and its output crosses before Ekv2E (2 E_kv per token: halves lsa0, lsa1), with the
    # K, V of the last TLI target layers (2 E_kv per TLI layer): 3A + 2A E_kv (TLI + 1) bytes an answer. The client
    # applies Ekv2E and writes the CA keys, TLI entries and SA entries as `_append_step` does.
    crossed = False  # a split's client: propose_rows reads the crossing from state.hidden, not the target's K/V

    def crossing(self) -> Crossing:
        e_kv = self.net.kv_dim // 2
        first = self.net.layers - self.net.tli
        tli = tuple((f"{kind}{layer}", e_kv) for layer in range(first, self.net.layers) for kind in "kv")
        return Crossing((("lsa0", e_kv), ("lsa1", e_kv), *tli), server=self._crossing_rows, client=self._cross)

    def _cross(self) -> None:
        self.crossed = True

    @torch.inference_mode()
    def _crossing_rows(self, state: TargetState) -> list[torch.Tensor]:
        """The server's half for row 0's fresh verified tokens: [n, E_kv] each (the LSA's output halves, then each TLI
        layer's K and V, KV heads side by side)."""
        n, end = state.fresh[0], state.lengths[0] - 1  # the fresh tokens' cache positions end - n .. end - 1
        new = [(k[0, :, end - n : end], v[0, :, end - n : end]) for k, v in (state.kv_static or state.kv)]
        per_layer = torch.stack([kv_per_token(k, v) for k, v in new], 1)  # [n, L, 2E_kv]
        out = self.net.lsa_mean(per_layer.to(self.net.Ekv2E.weight.dtype))  # [n, 2E_kv]
        rows = [*out.chunk(2, -1)]
        for k, v in new[len(new) - self.net.tli :]:  # [nkv, n, dh] -> [n, E_kv]
            rows += [k.transpose(0, 1).flatten(1), v.transpose(0, 1).flatten(1)]
        return rows

    def _append_crossed(self, prefixes: torch.Tensor, toks: torch.Tensor, rows: torch.Tensor) -> None:
        """`_append_step` from what crossed: rows [P, q, 2E_kv (1 + TLI)] (the LSA's output, then each TLI layer's K
        and V) for the verified tokens toks [P, q]."""
        (p, q), wdt, kvw = toks.shape, self.net.Ekv2E.weight.dtype, self.net.kv_dim
        pos, mask = self.cache.causal(prefixes, q, wdt)
        acts = self.net.Ekv2E(rows[..., :kvw].to(wdt))  # [P, q, E]
        self.cache.cache.layers[-1].write(*self.net.cross_attention.keys(acts, pos))
        dt, dh = self.target.dtype, self.tli_layers[0].self_attn.head_dim if self.net.tli else 1
        for i, cached in enumerate(self.cache.cache.layers[1:-1]):  # [P, q, E_kv] -> [P, nkv, q, dh]
            k, v = rows[..., kvw * (1 + i) : kvw * (2 + i)].to(dt).chunk(2, -1)
            cached.write(*(x.reshape(p, q, -1, dh).transpose(1, 2) for x in (k, v)))
        self.net.sa(self.embed(toks).to(wdt), pos, mask, self.cache.cache)

    @torch.inference_mode()
    def continue_alone(self, state: TargetState, max_new: int) -> torch.Tensor:
        """The target is gone (Table 4): greedy text of its own, [A, max_new], as one chain grown over its frozen
        activations (CA) and caches: each token through SA and the TLI layers over its drafted ancestors."""
        return chain_alone(self, state, max_new)


# ---- the authors' published layout -----------------------------------------------------------------------------------
# Two forms of the same tensors (`layer_self_attention.*`, `Ekv2E.*`, `self_attention.*`, `cross_attention.*`):
#   training's: `save_pretrained` of their MOASpecLlamaForCausalLM with the state dict cut to the drafter's tensors;
#     config.json is the target's Llama config (the widths are constructor arguments, not config fields);
#   vLLM's (their vllm/convert_checkpoint.py, what their README serves huawei-noah/MOASpec-Llama-3-8B-Instruct with, and
#     the hub's `moa_spec` tag on it): model_type "moa_spec", num_hidden_layers and num_key_value_heads deleted, every
#     width written into config.json from the tensors (CONVERTED_WIDTHS), which we check against the tensors.
AUTHORS_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size")
CONVERTED_FIELDS = ("hidden_size", "num_attention_heads", "vocab_size")
CONVERTED_WIDTHS = {"self_attention_num_key_value_heads": "sa_kv_heads", "self_attention_intermediate_size": "sa_mlp",
                    "cross_attention_num_key_value_heads": "ca_kv_heads", "cross_attention_intermediate_size": "ca_mlp",
                    "layer_self_attention_num_key_value_heads": "lsa_kv_heads",
                    "layer_self_attention_intermediate_size": "lsa_mlp"}


def is_authors_layout(path: Path) -> bool:
    """A config.json without the project's `drafter` metadata beside a weight file."""
    return authors_config(path) is not None


def load_authors_moa(path: Path, target, tli: int) -> MoAModule:
    """Build the module the checkpoint's tensors describe (every width and head count read from them; the LSA's query
    heads by the authors' rule, the target's count) and load it; each misfit is one line naming it."""
    cfg = json.loads((path / "config.json").read_text())
    converted = cfg.get("model_type") == "moa_spec"
    check_authors_config(path, cfg, target, CONVERTED_FIELDS if converted else AUTHORS_FIELDS, "a MoA drafter")
    if cfg.get("disable_LSA"):
        raise SpecbenchError(f"checkpoint {path} is a MoA drafter without its Layer Self-Attention (disable_LSA), "
                             "which this drafter always has")
    base = target.model.config
    state = read_state(path)
    if "Ekv2E.weight" not in state:
        raise SpecbenchError(f"checkpoint {path} is not a MoA drafter in its authors' layout (no Ekv2E.weight)")
    e, nh, nkv, dh = dims(base)
    if tuple(state["Ekv2E.weight"].shape) != (e, 2 * nkv * dh):
        raise SpecbenchError(f"checkpoint {path}: Ekv2E.weight is {tuple(state['Ekv2E.weight'].shape)}, the target "
                             f"{target.name!r} needs {(e, 2 * nkv * dh)} (E, 2 E_kv)")

    def width(key: str, per: int) -> int:
        if key not in state:
            raise SpecbenchError(f"checkpoint {path} does not fit a MoA drafter: missing {key!r}")
        return state[key].shape[0] // per

    lsa_dim = 2 * nkv * dh // nh
    opts = MoAOptions(tli=tli, lsa_head_dim=lsa_dim,
                      lsa_kv_heads=width("layer_self_attention.self_attn.k_proj.weight", lsa_dim),
                      lsa_mlp=width("layer_self_attention.mlp.gate_proj.weight", 1),
                      sa_kv_heads=width("self_attention.self_attn.k_proj.weight", dh),
                      sa_mlp=width("self_attention.mlp.gate_proj.weight", 1),
                      ca_kv_heads=width("cross_attention.self_attn.k_proj.weight", dh),
                      ca_mlp=width("cross_attention.mlp.gate_proj.weight", 1))
    recorded = {key: (cfg[key], getattr(opts, field)) for key, field in CONVERTED_WIDTHS.items() if key in cfg}
    recorded["kv_hidden_size"] = (cfg.get("kv_hidden_size", 2 * nkv * dh), 2 * nkv * dh)
    for key, (theirs, tensors) in recorded.items():
        if theirs != tensors:
            raise SpecbenchError(f"checkpoint {path}: config.json records {key}={theirs}, its tensors {tensors}")
    module = MoADrafter.build_module(target, opts)
    params = dict(module.named_parameters())
    copy_state(path, state, params, "a MoA drafter")
    return module.to(target.device, target.dtype)
