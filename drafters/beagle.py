"""Beagle (Zhong et al., "Cross-Attention Speculative Decoding", papers/000 Sec. 4): one cross-attention block.

Model (Eq. 1-2). For position n:  y_n = CrossAttn(h_{1:n-1}, e(t_n)) + e(t_n),  h_n = MLP(y_n) + y_n,
q_n = softmax(LMHead(h_n)) predicts t_{n+1}. Queries come from token embeddings only, keys/values from higher-level
states only (the target's true last hidden states, or the drafter's own predicted states); Mask_ij = 0 for j >= i
(the diagonal too). As in the target's layer: RMSNorm before attention (separately on queries and on states) and
before the MLP, RoPE at each side's own positions, GQA with the target's head counts, the target's MLP. The LM head
and embeddings are the target's, frozen and shared (not saved). No final norm (as our EAGLE head): h_n is regressed
onto the target's already-normalised state.

Decoding. The drafter's KV cache holds K_j, V_j of true states; within an SD iteration each drafted node's predicted
state is appended ("concate", the paper's best configuration; `concat: false` keeps only true states) and seen by its
descendants through the tree mask; after verification the drafted entries are dropped and the true states of the
accepted tokens appended (specbench/decode/draftcache.py: one row per batch row at every B). Tree: EAGLE-2's dynamic
tree (depth 1+6, top-k 10, 60 tokens, conf/tree/dynamic.yaml).

Two-Stage Block-Attention Training (Sec. 4.2, App. A.2-A.3). Windows of k (=5) positions start at w0 = eps + w k,
eps ~ U[0, k) per batch. Query at window position n+i (i = 1..k) keeps its token but sees states only up to n.
  Early stage (Eq. 4): L_early = sum_{j=1..k} E_{t~p_{n+j}}[-log q^{(j)}_n(t)]: every query is trained, each on the
  target's next-token distribution at its position, from states j steps stale (= drafting without concate).
  Late stage (Eq. 6, L_late = L(k, i, beta*)): s (=4) simulated steps; at step i the query at window position i is
  trained with weight beta*_i = k - i + 1 and sees true states up to n plus the states predicted at steps < i for
  n+1 .. n+i-1 (= drafting with concate). Predicted states go into a second key buffer of the same length ("in-place
  adding of next-predicted keys"): attention is always T queries x 2T keys, whatever s.
  Both stages add the feature regression ("vloss", SmoothL1 to the true state) with coefficient 10 and Gaussian
  noise N(0, 0.2) on the input states (App. A.3); losses are means over the trained queries of each step. The CE
  takes the stage's weight (k for Eq. 4's sum over lookaheads, beta*_i at step i); the vloss keeps its 10 (before
  2026-11-24 it was multiplied by k or beta* too: 20-50). Each late-stage step adds its own vloss x 10 (our reading:
  the paper gives one coefficient for "both stages" and does not say how it spreads over simulated steps). Scaled
  (module.vloss_scaled=true) on the embedded budget: validation sim tau 1.184 / 1.293 against 1.194 / 1.286, level
  (docs/training.md).
  Optimiser (App. A.3, conf/drafter/beagle.yaml): AdamW (0.9, 0.95), no weight decay named (torch's AdamW default
  0.01 is the authors' EAGLE replication's), gradients clipped to a maximum norm of 0.5, the lr constant after 2,000
  warm-up steps. Its peak is the budget's train.lr (3e-4 on the embedded budget, as every method's; the paper's
  3e-5 is conf/train/paper.yaml's): a deviation. At 3e-5 on the embedded budget validation sim tau falls from 1.286
  to 1.201 (docs/training.md).
Our reading where the text is silent: late-stage steps are independent graphs (predicted states enter the buffer
detached, like the paper's in-place writes) and are backpropagated one after another (TrainableDrafter.training_steps),
so peak memory does not grow with s; `late_from_epoch` switches stages (paper: epoch 10 of 20; our budget: 1 of 2).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbench.decode.drafter import HIDDEN, TrainableDrafter
from drafters.distill import soft_ce, teacher_probs, top1
from drafters.layers import CrossAttentionBlock, layers_config
from drafters.trees import Grown, GrowingTree, Level, make_tree
from specbench.decode.compiled import Region
from specbench.decode.draftcache import CachedRows, CompiledTree, DraftCache
from specbench.decode.kvcache import PreallocatedLayer
from specbench.decode.rows import RowCounts
from specbench.decode.tree import in_block, up_to_start, visible
from specbench.decode.types import DraftTree, TargetState


def window_starts(length: int, window: int, offset: int, device) -> torch.Tensor:
    """n(q) for every query position q: the last position whose state the query may see (window start), [L]."""
    q = torch.arange(length, device=device)
    rel = (q - offset - 1) % window + 1  # 1..k: the query's place in its window
    return q - rel


def simulated_steps(module, emb: torch.Tensor, states: torch.Tensor, real: torch.Tensor, start: torch.Tensor,
                    steps: int, trained: list[bool] | None = None) -> Iterator[torch.Tensor]:
    """Late-stage simulation (Fig. 2, right): yields the block's outputs [B, T, H] at steps i = 1..steps. At step i a
    query q sees the true states up to its window start n(q), and the states predicted at steps < i for positions
    n+1 .. min(n+i-1, q-1) of its own window, kept in a second buffer of T keys (detached). Step 1 = the early stage.
    emb [B, T, H] token embeddings, states [B, T, H] true (noised) states, real [B, T] bool, start [T] = n(q);
    trained[i-1] False runs step i without autograd (no loss there: it only fills the buffer)."""
    b, t, _ = emb.shape
    idx = torch.arange(t, device=emb.device)
    pos = idx[None].expand(b, -1)
    rel = idx - start
    see_true = up_to_start(start, real)  # [B, T, T]
    own = in_block(start, include_self=False)  # [T, T] earlier positions of the query's own window
    pred = torch.zeros_like(states)
    for i in range(1, steps + 1):
        with torch.set_grad_enabled(torch.is_grad_enabled() and (trained is None or trained[i - 1])):
            if i == 1:  # one key buffer: the true states
                out = module(emb, pos, see_true[:, None], states=states, states_pos=pos)
            else:  # and the second, of predicted states (a fixed 2T keys whatever i)
                see_pred = own & (rel[None, :] <= i - 1)  # ... whose states were predicted at steps < i
                allowed = torch.cat([see_true, see_pred[None] & real[:, None, :]], dim=-1)
                out = module(emb, pos, allowed[:, None], states=torch.cat([states, pred], 1),
                             states_pos=torch.cat([pos, pos], 1))
        yield out
        pred = torch.where((rel == i)[None, :, None], out.detach(), pred)


@dataclass
class BeagleOptions:
    window: int = 5  # k, the early stage's block-attention window (App. A.3)
    sim_steps: int = 4  # s, the late stage's simulated steps (App. A.3: limited to 4)
    late_from_epoch: int = 1  # the epoch the late stage starts
    vloss_weight: float = 10.0  # the feature-regression coefficient (App. A.3)
    vloss_scaled: bool = False  # true: vloss also takes the CE's k / beta* (this project's weighting before 2026-11-24)


class BeagleDrafter(CachedRows, TrainableDrafter):
    name = "beagle"
    needs = frozenset({HIDDEN})
    Options = BeagleOptions

    def __init__(self, target, checkpoint: str | None = None, module: dict | None = None, tree: dict | None = None,
                 concat: bool = True):
        self.block = self.load_module(target, checkpoint, module)
        self.embed, self.lm_head = target.decoder.embed_tokens, target.lm_head
        self.policy = make_tree(**(tree or {"kind": "dynamic"}))
        self.concat = concat
        self.target = target
        self.cache: DraftCache | None = None  # the block's K, V, per generation (prefill_rows)
        self.pending: tuple[torch.Tensor, RowCounts] | None = None  # (true states not yet in the cache [A, n, H],
        #                                                             each row's count of them)
        self.region = CompiledTree()  # model.compile: the tree's growth, compiled
        self.append_region = Region(self._append_step)  # and the append of new true states

    # ---- training side -------------------------------------------------------------------------------------------
    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        return {}  # every option is the training's: the block's shape is the target's

    @classmethod
    def build_module(cls, target, opts: BeagleOptions) -> CrossAttentionBlock:
        del opts  # the block's shape is the target's; the options are the training's
        return CrossAttentionBlock(target).to(target.device)

    @staticmethod
    def _step_loss(opts: BeagleOptions, out, batch, target, rows: torch.Tensor,
                   weight: float) -> tuple[torch.Tensor, float, float]:
        """weight x CE to the target's next-token law + vloss_weight x vloss, at the query positions `rows` [B, T]
        bool: the CE's weight is the stage's (k, or beta*_i), the vloss coefficient is App. A.3's 10 in both stages,
        never multiplied by k or beta."""
        pred, true = out[rows], batch.hidden[rows]  # [M, H]: h^_n vs h_n (q_n predicts t_{n+1})
        p = teacher_probs(target, true)
        logq = target.lm_head(pred.to(target.dtype)).float().log_softmax(-1)
        vloss = F.smooth_l1_loss(pred, true, reduction="none").mean(-1).mean()
        v_weight = opts.vloss_weight * (weight if opts.vloss_scaled else 1.0)
        return weight * soft_ce(p, logq) + v_weight * vloss, vloss.item(), top1(logq, p)

    @classmethod
    def training_loss(cls, module, batch, target, opts: BeagleOptions):
        """Early stage (Eq. 4), and the single-graph loss used by validation-free callers."""
        return next(cls.training_steps(module, batch, target, opts, epoch=0))

    @classmethod
    def training_steps(cls, module, batch, target, opts: BeagleOptions, epoch: int,
                       progress: float = 0.0) -> Iterator[tuple[torch.Tensor, dict]]:
        del progress  # the stages switch by epoch (App. A.3: epoch 10 of 20)
        t, dev = batch.input_ids.shape[1], batch.input_ids.device
        offset = int(torch.randint(0, opts.window, (1,)).item())  # eps ~ U[0, k) (torch's seeded stream)
        start = window_starts(t, opts.window, offset, dev)  # n(q), [T]
        rel = torch.arange(t, device=dev) - start  # the query's place in its window, 1..k
        # a query trains if it predicts an assistant token (loss_mask of t_{q+1}) and sees at least one state
        trainable = torch.zeros_like(batch.attn_mask, dtype=torch.bool)
        trainable[:, :-1] = batch.loss_mask[:, 1:].bool()
        trainable &= (start >= 0)[None]
        emb = target.decoder.embed_tokens(batch.input_ids)
        real = batch.attn_mask.bool()
        if epoch < opts.late_from_epoch:  # early stage: one pass, every query, states up to its window start
            out = next(simulated_steps(module, emb, batch.hidden_in, real, start, 1))
            # Eq. 4 sums the k lookaheads' CE: the mean over every trained query (each is one lookahead j) times k
            loss, vloss, agree = cls._step_loss(opts, out, batch, target, trainable, opts.window)
            yield loss, {"stage": 0, "vloss": vloss, "top1": agree}
            return
        rows = [trainable & (rel == i)[None] for i in range(1, opts.sim_steps + 1)]
        trained = [bool(r.any()) for r in rows]
        for i, out in enumerate(simulated_steps(module, emb, batch.hidden_in, real, start, opts.sim_steps, trained), 1):
            if trained[i - 1]:
                loss, vloss, agree = cls._step_loss(opts, out, batch, target, rows[i - 1], opts.window - i + 1)
                yield loss, {"stage": 1, f"vloss{i}": vloss, f"top1_{i}": agree}

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        embed, out = target.decoder.embed_tokens, []
        for t in positions:
            states, spos = hidden[None, :t], torch.arange(t, device=hidden.device)[None]
            tok, row = input_ids[t : t + 1], []
            for d in range(depth):
                allowed = visible(torch.zeros(1, 0, dtype=torch.bool, device=hidden.device), states.shape[1])
                h = module(embed(tok)[None], torch.tensor([[t + d]], device=hidden.device), allowed, states=states,
                           states_pos=spos)
                tok = target.lm_head(h.to(target.dtype))[0, -1].argmax(-1, keepdim=True)
                row.append(tok[0])
                states = torch.cat([states, h], 1)  # concate: the predicted state becomes a key
                spos = torch.cat([spos, torch.tensor([[t + d]], device=hidden.device)], 1)
            out.append(torch.stack(row))
        return torch.stack(out)

    # ---- decoding side -------------------------------------------------------------------------------------------
    # Every row of a batch, batch 1 included, drafts in the same forwards (the rows protocol): the block's K/V layer
    # (specbench/decode/draftcache.py; model.compile: a one-layer static cache of the batch's bucket) holds one row per
    # batch row (its verified states, then its drafted ones, behind its own length) and a level of the tree is one
    # forward over [A, n] nodes. model.compile: the append of the new true states (`_append_step`) and the whole tree
    # (CompiledTree) are compiled regions of the same code.
    def prefill_rows(self, state: TargetState) -> None:
        self.cache = DraftCache.for_decoder(self.target, layers_config(self.target), state, self.block)
        # true states of positions 0 .. L-1 (row b's first fresh[b]); the root t_L has none yet
        self.pending = (state.hidden, state.fresh)

    @property
    def kv(self) -> PreallocatedLayer:
        """The block's K/V layer: true states, then (while drafting) predicted ones."""
        return self.cache.cache.layers[0]

    def _append(self, states: torch.Tensor, pos: torch.Tensor) -> None:
        """states [A, Q, H] at positions pos [A, Q]: their K, V written behind each row's entries (the static cache's:
        at its offsets; no read of the window, so a region that only appends keeps one graph for every width)."""
        self.kv.write(*self.block.keys(states.to(self.block.q_proj.weight.dtype), pos))

    def _append_step(self, prefixes: torch.Tensor, states: torch.Tensor) -> None:
        """DraftCache.append's step: states [P, Q, H] behind each row's `prefixes` [P] verified ones."""
        self._append(states, prefixes[:, None] + torch.arange(states.shape[1], device=states.device))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h.to(self.lm_head.weight.dtype))

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        root_tok = state.lengths.last(state.tokens)[:, None]  # [A, 1] the last verified token
        states, fresh = self.pending
        self.cache.append(self._append_step, fresh, states, region=self.append_region)
        vocab = self.lm_head.weight.shape[0]
        # the drafted entries ("concate"): the root's and one per node fed to `expand`; none without
        entries = 1 + self.policy.expanded(vocab) if self.concat else 0
        return self.cache.grow(self._grow, root_tok, self.region, self.policy, vocab, entries)

    def _grow(self, root_tok: torch.Tensor, at, laid_out: bool) -> Grown:
        """The tree policy grown from the root tokens [A, 1]; each level runs the block on its nodes, each seeing its
        row's verified states and its drafted ancestors' slots, at the root's position + depth, its predicted states
        appended ("concate"). A level's rows are written behind the S slots they may see and a query never sees its
        own predicted state (Beagle's mask is strict), so `at` is given S + m columns, the last m unseen (and cut from
        the mask where the keys end before them); the root, at the verified count, is `at`'s depth 1. laid_out:
        inside CompiledTree's region (the keys: the static window's). Tensor ops only."""
        a, dev, dtype = root_tok.shape[0], root_tok.device, self.block.q_proj.weight.dtype
        # the predicted states' drafted cache entries ("concate" only): slot 0 is the root's, seen by every node
        book = GrowingTree(self.policy.max_nodes, dev, root_slot=True, trees=a) if self.concat else None

        def level(tokens: torch.Tensor, seen: torch.Tensor, depth: int) -> torch.Tensor:
            p, mask = at(torch.cat([seen, seen.new_zeros(*tokens.shape, tokens.shape[1])], -1), depth + 1, dtype)
            kv = self.kv.window_kv() if laid_out else (self.kv.keys, self.kv.values)
            h = self.block(self.embed(tokens).to(dtype), p, mask[..., : kv[0].shape[-2]], kv=kv)
            if self.concat:
                self._append(h, p)
            return h

        h_root = level(root_tok, torch.zeros(a, 1, 0, dtype=torch.bool, device=dev), 0)  # [A, 1, H]

        def expand(lv: Level) -> torch.Tensor:
            # strictly earlier: a node's drafted ancestors and the root, never itself (none without "concate")
            seen = (book.ancestors(lv.parents) if self.concat
                    else torch.zeros(*lv.nodes.shape, 0, dtype=torch.bool, device=dev))
            h = level(lv.tokens, seen, lv.depth)
            if self.concat:
                book.add(lv.nodes, lv.parents)  # their states were appended, in node order
            return self._logits(h)

        return self.policy.grow_rows(self._logits(h_root[:, 0]), expand)

    def on_verified_rows(self, state: TargetState) -> None:
        self.pending = (state.hidden, state.fresh)  # true states of the root and the accepted path
