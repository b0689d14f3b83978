"""HASS (Zhang et al., "Learning Harmonized Representations for Speculative Sampling"; papers/001, HASS slides):
the EAGLE head and EAGLE-2 tree at decoding time, trained differently.

Harmonized context alignment (n steps, default 3). EAGLE's pair at position i is x^1_i = FC(e(t_{i+1}), f_i) with the
target's feature f_i, predicting F^1_{i+1}. Step j feeds the drafter its own previous predictions,
x^j_i = FC(e(t_{i+1}), F^{j-1}_i), and the query at i sees what it would see as the j-th draft token of a tree
rooted at p = i - j + 1: target-feature keys x^1 at positions <= p, and the drafted keys x^k at position p + k - 1
for k = 2..j (itself included). With a stock decoder layer this is one forward over the concatenated steps
[x^1; ...; x^j] (positions repeated) with that 4D mask; outputs of earlier steps are recomputed identically.
Training as the authors' `train/main_hass.py` does it: step j's inputs take the previous steps' predictions
*detached*, step j is its own graph and is backpropagated before step j+1 is built (so peak memory is one step's
graph, as Beagle's training-memory comparison measures), and the step losses are summed (each backward adds its
gradient). Step j's loss is EAGLE's (w_reg = 1, w_cls = 0.1) plus harmonized objective distillation:
    L_topK = - sum_{x in top-K of p_target} p_target(x) log q_draft(x),  K = 10 (papers/001: "K = 10"), weight 1.0.
Schedule, the authors' `train.sh` mapped onto our budget: they train 40 epochs without the Top-K term (`--topk_w 0`,
lr 3e-5) and then 10 more with it (`--topk_w 1`, lr 1e-5), a second run that starts from the first's weights with a
fresh optimiser and its own warm-up and decay. Here the same inside the one budget: the last `topk_stage` (1/5 = 10 of
50 epochs) of the steps is a Restart (specbench/decode/drafter.py) with a fresh AdamW and the budget's warm-up and cosine over
its own steps, peaking at train.lr x `topk_lr_scale` (1/3 = 1e-5 / 3e-5), with the Top-K term on.
The concatenated-steps forward also recomputes the earlier steps' outputs (unused), at about twice the compute of
step j alone; the earlier steps' keys/values come from the same detached inputs, so step j's gradient is unchanged.

Training attention (`module.train_attention`). The authors' training layer (`model/cnets_hass.py`,
LlamaAttention.forward) does not add its mask: it *multiplies* the logits by the 0/1 alignment masks, so each of the
n key positions a query may not see enters the softmax with logit 0 (weight exp(0) in the denominator), and zeroes
those probabilities afterwards without renormalising (`softmax(w * mask) * mask`); the pads and the future count
among them. Their drafting (`model/cnets.py`) adds the usual -inf mask. `authors` (the default: their published
heads and numbers were trained so) reproduces the training form: a query seeing v of the n positions of its step
gets softmax over its v logits and n - v zero logits, the latter with no value (`authors_attention`, registered as
an HF attention function; tests/test_hass.py checks it against a literal port of their loop). `additive` trains
with the same -inf mask as drafting. Drafting is additive either way.
Feature noise: the authors' `main_hass.py` (as EAGLE's `main.py`) draws (rand - 0.5) * 0.2 * 512 / T on the input
features, T the sequence's length (uniform of half-width 51.2 / T: 0.1 at T = 512); here, as for EAGLE, the paper's
U(-0.1, 0.1) (conf/drafter/hass.yaml: optim.noise), the same at T = 512 and independent of the length.
Other deviations from the authors' code (docs/drafters.md): the budget's peak lr 3e-4 and 1e-4 for the Top-K stage
(theirs 3e-5 and 1e-5, the same 3:1), and the budget's schedule shape (20 warm-up steps, cosine) where theirs is linear
with 1% warm-up in both stages; the concatenated-steps forward above.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from drafters.distill import soft_ce, teacher_probs
from drafters.eagle import EagleDrafter, EagleOptions, trained_positions
from specbench.decode.drafter import Restart
from specbench.decode.tree import additive, harmonized


AUTHORS_ATTENTION = "hass_authors"
TRAIN_ATTENTION = ("authors", "additive")


def authors_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      zero_logits: torch.Tensor | None = None, **kwargs):
    """HASS's training attention (cnets_hass.py): softmax over the visible keys' logits plus `zero_logits` [B, 1, Q]
    keys of logit 0 and no value (the positions the authors' multiplied mask hides). query [B, nh, Q, d], key/value
    [B, nkv, K, d], attention_mask [B, 1, Q, K] additive (dtype-min where hidden) -> ([B, Q, nh, d], None). Without
    `zero_logits` it is SDPA (drafting, and the `additive` form)."""
    if zero_logits is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    w = (query @ key.transpose(2, 3)) * scaling + attention_mask[..., : key.shape[-2]]
    null = zero_logits.float().clamp(min=1e-30).log()[..., None].expand(*w.shape[:-1], 1)  # log(count) x exp(0)
    p = torch.cat([w.float(), null], -1).softmax(-1)[..., :-1].to(value.dtype)
    return (p @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(AUTHORS_ATTENTION, authors_attention)


def harmonized_inputs(emb: torch.Tensor, feats: list[torch.Tensor], pad: torch.Tensor, zero_logits: bool = False):
    """The concatenated-steps forward for step j = len(feats): (emb [B, jn, H], feat [B, jn, H], positions [B, jn],
    additive mask [B, 1, jn, jn], the count of hidden positions per query [B, 1, jn] where `zero_logits` (the
    authors' training attention: each of the n positions of a step a query does not see is one logit 0) else None)."""
    b, n, _ = emb.shape
    j = len(feats)
    pos = torch.arange(n, device=emb.device).repeat(j)[None].expand(b, -1)
    allowed = harmonized(n, j, emb.device)[None] & (pad.repeat(1, j) != 0)[:, None, :]  # [B, jn, jn]
    hidden = (n - allowed.sum(-1))[:, None].to(emb.dtype) if zero_logits else None  # one key per seen position
    return emb.repeat(1, j, 1), torch.cat(feats, dim=1), pos, additive(allowed[:, None], emb.dtype), hidden


def next_step_input(feat0: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Step j+1 reads F^j_i, step j's output at position i-1 (position 0 keeps the target feature)."""
    return torch.cat([feat0[:, :1], pred[:, :-1]], dim=1)


def harmonized_steps(module, emb: torch.Tensor, feat0: torch.Tensor, pad: torch.Tensor, steps: int,
                     detach: bool = True, attention: str = "additive") -> Iterator[torch.Tensor]:
    """emb = e(t_{i+1}) [B, n, H], feat0 = f_i [B, n, H], pad [B, n] (1 = real) -> F^j_{i+1} [B, n, H] for j = 1..steps,
    one at a time: each step's forward is built when the caller asks for it (after it backpropagated the previous one).
    Step j+1 reads step j's prediction detached (the authors' `q_hidden_states.detach()`). attention: `authors`
    (their training attention, on a module built with it: `use_authors_attention`) or `additive`."""
    if attention not in TRAIN_ATTENTION:
        raise ValueError(f"hass train_attention={attention!r} is not one of {', '.join(TRAIN_ATTENTION)}")
    authors = attention == "authors"
    if authors and module.body.config._attn_implementation != AUTHORS_ATTENTION:
        raise ValueError("train_attention=authors needs a head built with use_authors_attention")
    n = emb.shape[1]
    feats = [feat0]
    for j in range(1, steps + 1):
        e, f, pos, mask, hidden = harmonized_inputs(emb, feats, pad, zero_logits=authors)
        extra = {"zero_logits": hidden} if authors else {}
        pred = module(e, f, position_ids=pos, attention_mask=mask, **extra)[:, (j - 1) * n :]
        nxt = next_step_input(feat0, pred)
        feats.append(nxt.detach() if detach else nxt)
        yield pred


@dataclass
class HassOptions(EagleOptions):
    steps: int = 3  # harmonized context alignment steps n
    topk: int = 10  # K of the Top-K distillation (papers/001: "K = 10")
    topk_weight: float = 1.0  # its weight (the authors' --topk_w 1)
    topk_stage: float = 0.2  # the last fraction of the steps: the authors' second stage (10 of 50 epochs)
    topk_lr_scale: float = 1 / 3  # its peak lr relative to the first stage's (the authors' 1e-5 after 3e-5)
    topk_restart: bool = True  # the second stage starts a fresh optimiser and lr schedule (train.sh: a second run)
    train_attention: str = "authors"  # authors: cnets_hass.py's multiplied mask (hidden keys at logit 0); additive


def use_authors_attention(head) -> None:
    """Route the head's layer through `authors_attention` (SDPA unless a forward passes zero_logits)."""
    head.body.set_attn_implementation(AUTHORS_ATTENTION)


class HassDrafter(EagleDrafter):
    name = "hass"
    Options = HassOptions
    w_reg = 1.0  # EAGLE's weights (the authors' v_w = 1.0, p_w = 0.1); CORAL halves w_reg

    @classmethod
    def step_targets(cls, batch, target, loss_mask: str = "predicted"):
        """(e(t_{i+1}) [B, n, H], loss positions [B, n], targets f_{i+1} [M, H], the target's law p [M, V]);
        loss_mask: the positions' form (eagle.trained_positions)."""
        emb = target.decoder.embed_tokens(batch.input_ids[:, 1:])  # e(t_{i+1})
        mask_tok = trained_positions(batch.loss_mask, batch.attn_mask, loss_mask)  # [B, n]: F_{i+1} trains
        true = batch.hidden[:, 1:][mask_tok]
        return emb, mask_tok, true, teacher_probs(target, true)

    @classmethod
    def step_loss(cls, pred: torch.Tensor, true: torch.Tensor, p: torch.Tensor, target, topk: int, topk_weight: float):
        """One step's w_reg L_reg + w_cls L_cls (+ topk_weight L_topK over the target's top-`topk`), the LM head
        applied at loss positions only. pred, true [M, H]; p [M, V]."""
        reg = F.smooth_l1_loss(pred, true, reduction="none").mean(-1).mean()
        logq = target.lm_head(pred.to(target.dtype)).float().log_softmax(-1)
        loss = cls.w_reg * reg + cls.w_cls * soft_ce(p, logq)
        parts = {"reg": reg.item()}
        if topk_weight:
            top_p, top_idx = p.topk(topk, dim=-1)
            topk_loss = -(top_p * logq.gather(-1, top_idx)).sum(-1).mean()
            loss = loss + topk_weight * topk_loss
            parts["top"] = topk_loss.item()
        return loss, parts

    @classmethod
    def build_module(cls, target, opts: HassOptions):
        attention = getattr(opts, "train_attention", "additive")  # (CORAL's options have none: additive)
        if attention not in TRAIN_ATTENTION:
            raise ValueError(f"hass train_attention={attention!r} is not one of {', '.join(TRAIN_ATTENTION)}")
        head = super().build_module(target, opts)
        if attention == "authors":
            use_authors_attention(head)
        return head

    @classmethod
    def load_module(cls, target, checkpoint, options):
        """The decoding module: EAGLE's head with stock SDPA attention (the authors' drafting adds its mask)."""
        head = super().load_module(target, checkpoint, options)
        if head.body.config._attn_implementation == AUTHORS_ATTENTION:
            head.body.set_attn_implementation("sdpa")
        return head

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        """Decoding is EAGLE's: the training-only options (steps, Top-K, schedule) are dropped, so checkpoints made
        under earlier option names load too."""
        keep = {f.name for f in fields(EagleOptions)} - {"loss_mask"}
        return {k: v for k, v in options.items() if k in keep}

    @staticmethod
    def topk_on(opts: HassOptions, progress: float) -> bool:
        """Whether the Top-K stage has begun: the step the Restart starts at (specbench.train.stage_starts) onward."""
        return opts.topk_stage > 0 and progress >= 1.0 - opts.topk_stage - 1e-9

    @classmethod
    def restarts(cls, opts: HassOptions):
        if not 0.0 <= opts.topk_stage < 1.0:
            raise ValueError(f"hass topk_stage={opts.topk_stage} must be in [0, 1)")
        if not (opts.topk_restart and opts.topk_stage):
            return ()
        return (Restart(at=1.0 - opts.topk_stage, lr_scale=opts.topk_lr_scale),)

    @classmethod
    def training_steps(cls, module, batch, target, opts: HassOptions, epoch: int,
                       progress: float = 0.0) -> Iterator[tuple[torch.Tensor, dict[str, float]]]:
        """The n harmonized steps as n graphs, each backpropagated by the trainer before the next is built."""
        del epoch
        emb, mask_tok, true, p = cls.step_targets(batch, target, opts.loss_mask)
        w_topk = opts.topk_weight if cls.topk_on(opts, progress) else 0.0
        steps = harmonized_steps(module, emb, batch.hidden_in[:, :-1], batch.attn_mask[:, 1:], opts.steps,
                                 attention=opts.train_attention)
        for j, pred_all in enumerate(steps, 1):
            loss, parts = cls.step_loss(pred_all[mask_tok], true, p, target, opts.topk, w_topk)
            yield loss, {f"{k}{j}": v for k, v in parts.items()}

    @classmethod
    def training_loss(cls, module, batch, target, opts: HassOptions):
        """The summed step losses at the schedule's end (its Top-K stage on) as one number, for tests and tools
        (training backpropagates step by step); CORAL's too."""
        loss, parts = 0.0, {}
        for piece, part in cls.training_steps(module, batch, target, opts, epoch=0, progress=1.0):
            loss, parts = loss + piece, {**parts, **part}
        return loss, parts
