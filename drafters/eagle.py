"""EAGLE (Li et al. 2024, papers/004 Sec. 4) with EAGLE-1's static tree (`eagle`) or EAGLE-2's dynamic tree
(`eagle2`): the same head and the same trained weights, the tree policy from conf/tree/.

Head ("Auto-regression Head"): f^_{i+1} = Decoder(FC(concat(e(t_{i+1}), f_i))), one decoder layer of the target's
architecture (its own positions / attention / MLP), no final norm: f^ goes straight to the target's frozen LM head,
as the target's own feature does. Embedding and LM head are the target's (shared, frozen, not saved).
Drafting is feature-level autoregression: a drafted node's input pair is (its parent's predicted feature, its token).
Training (Sec. 4.2): L = SmoothL1(f_{i+1}, f^_{i+1}) + w_cls * CE(p_{i+2}, p^_{i+2}) with w_cls = 0.1 and
p = softmax(LMHead(f)); uniform noise U(-0.1, 0.1) on the input features (conf: optim.noise); gradients clipped by
value at 0.5 (the authors' `clip_grad_value_`, conf/train: grad_clip_mode).

The authors' architecture (SafeAILab/EAGLE `cnets.py`, `Model` / `LlamaDecoderLayer(index=0)`), which the published
heads (yuhuili/EAGLE-*, HArmonizedSS/HASS-*) need: layer 0 has **no input RMSNorm** (an identity here, not a norm of
weight 1: `input_norm=False`), `fc` = Linear(2H, H) with a bias unless the checkpoint's config says `bias: false`, the
decoder's own `rms_norm_eps` (a module option, recorded when set, as a published head's config sets it; unset: the
target's, which the target's config records). The concatenation order is
(embedding, feature), as theirs.

The head keeps its own KV cache over verified pairs (f_i, t_{i+1}) (specbench/decode/draftcache.py, one row per batch
row at every B); drafted entries are appended while a tree grows (tree attention over the draft's own cache) and
dropped before verification; after verification the new pairs (true features of the root and the accepted path, with
the next tokens) are appended at the next propose.
With model.compile the head runs on a static cache, and the whole tree after the root (every level's head forward,
LM head, top-k and the policy's bookkeeping) is one compiled region (specbench/decode/draftcache.py CompiledTree, issue 48).

Draft vocabulary (`+drafter.module.draft_vocab=N`, eagle / eagle2 / hass / coral; not EAGLE's, EAGLE-3's idea applied
at decoding time): drafted rows are scored by the N rows of the target's LM head for the N most frequent answer
tokens (specbench.vocab, counted from the training answers) and scattered back into the vocabulary, -inf elsewhere.
The head's weights are unchanged and the target verifies every drafted token, so the output is unchanged (lossless);
what changes is the draft time (N of V rows per drafted row) and tau (a token outside the N cannot be drafted).

Deviations from the authors' code (docs/drafters.md):
- feature noise: the paper's U(-0.1, 0.1); their code's (rand - 0.5) * 0.2 * 512 / T depends on the sequence length T
  (equal at T = 512, wider below); trained on the embedded budget, the two validate within 0.004 sim tau at two seeds
  that differ by 0.045 (docs/training.md);
- loss mask: a position trains when the token its feature predicts is an answer token, two positions apart from theirs
  (`module.loss_mask=authors` trains theirs: trained_positions);
- the committed eagle / eagle2 / coral / coral_router weights were trained with weight decay 0.0, before the family's
  became their 0.01 (a shrink of ~0.2% in all at this budget; retrained at 0.01, the same validation to 3 decimals);
- the optimiser is the budget's (conf/train: peak lr 3e-4, cosine), as every method's; theirs 3e-5 for 20 epochs
  (on the embedded budget theirs validates at sim tau 1.191 against 1.527: docs/training.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specbench.decode.drafter import HIDDEN, TrainableDrafter
from drafters.distill import soft_ce, teacher_probs, top1
from drafters.layers import one_layer_decoder
from drafters.trees import Grown, chain_alone, grow_by_features, make_tree
from specbench.decode.checkpoints import authors_config, check_authors_config, copy_state, read_state
from specbench.decode.compiled import decode
from specbench.decode.draftcache import CachedRows, CompiledTree, DraftCache
from specbench.decode.rows import RowCounts
from specbench.errors import SpecbenchError
from specbench.decode.types import DraftTree, TargetState
from specbench.decode.verifier import Crossing
from specbench.decode.vocab import COUNTS_FILE, PrunedLMHead, pruned_lm_head


class EagleHead(nn.Module):
    def __init__(self, target, bias: bool = True, input_norm: bool = False, rms_norm_eps: float | None = None):
        super().__init__()
        h = target.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bias)
        # inputs are FC outputs (tokens are embedded with the target's table); f^ feeds the LM head directly, like the
        # target's (already normed) feature
        self.body = one_layer_decoder(target, **({} if rms_norm_eps is None else {"rms_norm_eps": rms_norm_eps}))
        if not input_norm:  # the authors' layer 0 skips its input norm: FC's output enters attention as it is
            self.body.layers[0].input_layernorm = nn.Identity()
        self.router: nn.Module | None = None  # CORAL's LM-head router (drafters/coral.py), attached in its stage 2

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                route: bool = False, laid_out: bool = False, **attention):
        """emb, feat [B, Q, H] -> predicted next features [B, Q, H]; with route=True also the router's group logits
        [B, Q, N]. `attention`: keywords for the layer's attention function (HASS's training form, drafters/hass.py)."""
        x = self.fc(torch.cat([emb, feat], dim=-1))
        # (on model.compile's static cache, the compiled body: specbench/decode/compiled.py)
        out = decode(self.body, cache, laid_out, inputs_embeds=x, position_ids=position_ids,
                     attention_mask=attention_mask, **attention)
        return (out, self.router(out)) if route else out


# the authors' layout (SafeAILab/EAGLE `cnets.py` Model; the published yuhuili/EAGLE-*, HArmonizedSS/HASS-* heads):
# config.json (a Llama config of one layer, optional `bias`) + pytorch_model.bin or model.safetensors
AUTHORS_DIMS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def is_authors_layout(path: Path) -> bool:
    """An authors' EAGLE checkpoint: a Llama config (not the project's `drafter` metadata) beside their weight file."""
    meta = authors_config(path)
    return meta is not None and "hidden_size" in meta


def load_authors_head(path: Path, target) -> "EagleHead":
    """Build the head the checkpoint's config describes and load its tensors under the authors' key names: `fc.*`,
    `layers.0.*` (ours: `body.layers.0.*`), an optional `embed_tokens.weight` (the target's table is used; its shape is
    checked). Each misfit is one line naming it."""
    cfg = json.loads((path / "config.json").read_text())
    check_authors_config(path, cfg, target, AUTHORS_DIMS, "an EAGLE head")
    state = read_state(path)
    emb = state.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb.shape) != tuple(target.decoder.embed_tokens.weight.shape):
        raise SpecbenchError(f"checkpoint {path}: embed_tokens {tuple(emb.shape)} does not match the target's "
                             f"{tuple(target.decoder.embed_tokens.weight.shape)} (another vocabulary)")
    head = EagleHead(target, bias=bool(cfg.get("bias", True)),
                     input_norm="layers.0.input_layernorm.weight" in state, rms_norm_eps=cfg.get("rms_norm_eps"))
    params = {k.removeprefix("body."): p for k, p in head.named_parameters()}  # in the authors' names
    copy_state(path, state, params, "an EAGLE head")
    return head.to(target.device, target.dtype)  # the authors: ea_layer.to(base_model.dtype)


def save_authors_head(head: "EagleHead", target, out: Path) -> Path:
    """Write `head` in the authors' layout (the inverse of load_authors_head): config.json, a Llama config of one
    layer with `bias`, and pytorch_model.bin with `fc.*`, `layers.0.*` and the target's `embed_tokens.weight` (the
    authors' `Model` holds its own copy and loads its state strictly). Used by `make peer` to put one head into both
    implementations. A head with an input norm cannot be written: the authors' layer 0 has none."""
    if not isinstance(head.body.layers[0].input_layernorm, nn.Identity):
        raise SpecbenchError("this EAGLE head has an input RMSNorm in layer 0; the authors' layout has none")
    base = target.model.config
    layer0 = head.body.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
           "bias": head.fc.bias is not None, "vocab_size": target.vocab_size,
           "rms_norm_eps": layer0.rms_norm_eps, "hidden_act": layer0.hidden_act,
           "max_position_embeddings": base.max_position_embeddings, "rope_scaling": None,
           "rope_theta": float((getattr(base, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
           "pad_token_id": base.pad_token_id, "bos_token_id": base.bos_token_id, "eos_token_id": base.eos_token_id,
           **{k: getattr(base, k) for k in AUTHORS_DIMS}}
    state = {k.removeprefix("body."): p.detach().cpu().contiguous() for k, p in head.named_parameters()
             if not k.startswith("router.")}
    state["embed_tokens.weight"] = target.decoder.embed_tokens.weight.detach().cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    torch.save(state, out / "pytorch_model.bin")
    return out


LOSS_MASKS = ("predicted", "authors")


def trained_positions(loss_mask: torch.Tensor, attn_mask: torch.Tensor, form: str = "predicted") -> torch.Tensor:
    """Which predictions f^_{i+1} (from f_i and t_{i+1}; target f_{i+1}, whose LM head predicts t_{i+2}) train:
    loss_mask, attn_mask [B, T] -> [B, T-1] bool, i = 0 .. T-2. predicted (ours): t_{i+2} is an answer token (never
    i = T-2: no t_T). authors: t_i is an answer token and t_{i+1} a real one (their main.py pairs the unshifted
    loss_mask[j] with the target hidden[j+1] and zeroes it at the last token, whose target is padding). Theirs drops
    the predictions of each answer's first two tokens, trains the one from an answer's last token (its target the
    last hidden state, its token past the answer), and in a conversation of several turns trains two past each
    answer's end."""
    if form not in LOSS_MASKS:
        raise SpecbenchError(f"loss_mask={form!r} is not one of {', '.join(LOSS_MASKS)}")
    if form == "predicted":
        return F.pad(loss_mask[:, 2:], (0, 1)).bool()
    return (loss_mask[:, :-1] * attn_mask[:, 1:]).bool()


@dataclass
class EagleOptions:
    bias: bool = True  # fc's bias (the authors' default; a published config may say `bias: false`)
    input_norm: bool = False  # the authors' layer 0 has none
    rms_norm_eps: float | None = None  # None: the target's
    # decoding only (not the module's shape; read from the run's config, never from a checkpoint):
    draft_vocab: int | None = None  # N: draft over the N most frequent answer tokens only (None: the whole vocabulary)
    vocab_counts: str | None = None  # their counts (specbench.vocab); None: token_counts.safetensors beside the weights
    # training only: which positions train (trained_positions): predicted (ours) | authors (the whole family's)
    loss_mask: str = "predicted"

    def __post_init__(self):
        trained_positions(torch.zeros(1, 3), torch.zeros(1, 3), self.loss_mask)  # an unknown form fails early


class EagleDrafter(CachedRows, TrainableDrafter):
    name = "eagle"
    needs = frozenset({HIDDEN})
    Options = EagleOptions
    w_cls = 0.1  # Sec. 4.2: L = L_reg + w_cls L_cls
    prunable = True  # its drafting applies the target's whole LM head: module.draft_vocab may prune it

    def __init__(self, target, checkpoint: str | None = None, module: dict | None = None, tree: dict | None = None):
        self.head = self.load_module(target, checkpoint, module)
        self.target = target
        self.embed, self.lm_head = target.decoder.embed_tokens, target.lm_head
        self.policy = make_tree(**(tree or {"kind": "dynamic"}))
        self.vocab = self.pruned_head(target, checkpoint, module or {})
        self.cache: DraftCache | None = None  # the head's cache, per generation (prefill_rows)
        self.pending: tuple[torch.Tensor, torch.Tensor, RowCounts] | None = None  # (features [A,n,H], next tokens
        #                                                                             [A,n], each row's count)
        self.region = CompiledTree()  # model.compile: the tree's growth, compiled

    @classmethod
    def pruned_head(cls, target, checkpoint: str | None, module: dict) -> PrunedLMHead | None:
        """Draft-vocabulary pruning (issue 28): the run's `module.draft_vocab` most frequent tokens, ranked by the
        counts in `module.vocab_counts` or beside the weights; None without the option."""
        n = module.get("draft_vocab")
        if n is None:
            return None
        if not cls.prunable:
            raise SpecbenchError(f"drafter {cls.name!r} drafts through its own router, not the whole LM head: "
                                 f"module.draft_vocab does not apply")
        counts = module.get("vocab_counts") or (Path(checkpoint).parent / COUNTS_FILE if checkpoint else None)
        return pruned_lm_head(target, int(n), None if counts is None else Path(counts))

    def save_authors_layout(self, out: Path, target=None) -> Path:
        """This head in the authors' layout (save_authors_head): what `make peer` gives their EaModel; `target`: the
        one its config describes (default: the drafter's; make peer's variant of the same weights with another RoPE
        base)."""
        return save_authors_head(self.head, target or self.target, out)

    # ---- training side -------------------------------------------------------------------------------------------
    @classmethod
    def load_published(cls, target, path: Path, options: dict) -> nn.Module | None:
        return load_authors_head(path, target) if is_authors_layout(path) else None

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        return {k: v for k, v in options.items() if k != "loss_mask"}  # (training only: not in a run's name)

    @classmethod
    def build_module(cls, target, opts: EagleOptions) -> EagleHead:
        return EagleHead(target, bias=opts.bias, input_norm=opts.input_norm,
                         rms_norm_eps=opts.rms_norm_eps).to(target.device)

    @classmethod
    def training_loss(cls, module, batch, target, opts: EagleOptions):
        emb = target.decoder.embed_tokens(batch.input_ids[:, 1:])  # e(t_{i+1})
        pred = module(emb, batch.hidden_in[:, :-1], attention_mask=batch.attn_mask[:, 1:])  # f^_{i+1}, [B, T-1, H]
        mask = trained_positions(batch.loss_mask, batch.attn_mask, opts.loss_mask)  # [B, T-1]
        pred, true = pred[mask], batch.hidden[:, 1:][mask]  # [M, H] f^_{i+1} against f_{i+1}
        reg = F.smooth_l1_loss(pred, true, reduction="none").mean(-1).mean()
        p = teacher_probs(target, true)
        logq = target.lm_head(pred.to(target.dtype)).float().log_softmax(-1)
        cls_loss = soft_ce(p, logq)
        return reg + cls.w_cls * cls_loss, {"reg": reg.item(), "cls": cls_loss.item(), "top1": top1(logq, p)}

    @staticmethod
    def draft_logits(head: EagleHead, lm_head: nn.Module, f: torch.Tensor) -> torch.Tensor:
        """Next-token scores of predicted features f [..., H] -> [..., V]: the target's frozen LM head (CORAL's router
        variant overrides this)."""
        return lm_head(f.to(lm_head.weight.dtype))

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        embed, out = target.decoder.embed_tokens, []
        for t in positions:
            cache = DynamicCache(config=module.body.config)
            f = module(embed(input_ids[None, 1 : t + 1]), hidden[None, :t], cache)[:, -1:]  # f^_t
            row = []
            for d in range(depth):
                x = cls.draft_logits(module, target.lm_head, f).argmax(-1)  # [1, 1]
                row.append(x[0, 0])
                f = module(embed(x), f, cache, position_ids=torch.tensor([[t + d]], device=f.device))
            out.append(torch.stack(row))
        return torch.stack(out)

    # ---- decoding side -------------------------------------------------------------------------------------------
    # Every row of a batch, batch 1 included, drafts in the same forwards (the rows protocol): the head's cache
    # (specbench/decode/draftcache.py) holds one row per batch row (its verified pairs, then its drafted entries,
    # behind its own length) and a level of the tree is one forward over [A, n] nodes.
    def prefill_rows(self, state: TargetState) -> None:
        self.cache = DraftCache.for_decoder(self.target, self.head.body.config, state, self.head.body)
        # pairs (f_i, t_{i+1}), i = 0 .. L-1: row b's first fresh[b]
        self.pending = (state.hidden, state.fresh_tokens(), state.fresh)

    def _logits(self, f: torch.Tensor) -> torch.Tensor:
        if self.vocab is not None:  # module.draft_vocab: the LM head's N frequent rows only
            return self.vocab(f)
        return self.draft_logits(self.head, self.lm_head, f)

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        feats, toks, fresh = self.pending
        # row b's new pairs at positions verified[b] + j, j < fresh[b], causal among themselves
        pos, mask = self.cache.extend(fresh, toks.shape[1], feats.dtype)
        out = self.head(self.embed(toks), feats.to(self.head.fc.weight.dtype), self.cache.cache, position_ids=pos,
                        attention_mask=mask)  # [A, n, H]
        root_f = fresh.last(out)  # [A, H]
        self.cache.commit(fresh)
        # model.compile: the tree one compiled region (draft_logits reads nothing on the host, CORAL's router's neither)
        return self.cache.grow(self._grow, root_f, self.region, self.policy, self.lm_head.weight.shape[0])

    def _grow(self, root_f: torch.Tensor, at, laid_out: bool) -> Grown:
        """The tree policy grown from the root's feature [A, H]; each level one head forward over its [A, m] nodes in
        the head's cache, a node's input pair (its parent's predicted feature, its token) (laid_out: inside
        CompiledTree's region, which sets the cache's write offsets there). Tensor ops only."""
        def step(tokens: torch.Tensor, f_in: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens), f_in, self.cache.cache, position_ids=pos, attention_mask=mask,
                             laid_out=laid_out)

        return grow_by_features(self.policy, root_f, at, root_f.dtype, step, self._logits)

    def on_verified_rows(self, state: TargetState) -> None:
        # root + accepted path: pairs (f_T, t_{T+1}) ... (f_{T+A}, t_{T+A+1})
        self.pending = (state.hidden, state.fresh_tokens(), state.fresh)

    # ---- client-server split (specbench/deploy, issue 78) ----------------------------------------------------------
    def crossing(self) -> Crossing:
        """Split: the target's last hidden state of each verified token crosses (Table 7's A*E), read as ever from
        state.hidden."""
        hidden = self.embed.weight.shape[1]
        return Crossing((("hidden", hidden),), server=lambda st: [st.hidden[0, : st.fresh[0]]])

    @torch.inference_mode()
    def continue_alone(self, state: TargetState, max_new: int) -> torch.Tensor:
        """The target is gone (Table 4): greedy text of its own, [A, max_new], as one chain grown by its tree
        growth, each token fed its parent's predicted feature (EAGLE-2 feeding back its own features)."""
        return chain_alone(self, state, max_new)
