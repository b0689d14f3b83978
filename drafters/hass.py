"""HASS (Zhang et al., "Learning Harmonized Representations for Speculative Sampling"; papers/001, HASS slides):
the EAGLE head and EAGLE-2 tree at decoding time, trained differently.

Harmonized context alignment (n steps, default 3). EAGLE's pair at position i is x^1_i = FC(e(t_{i+1}), f_i) with the
target's feature f_i, predicting F^1_{i+1}. Step j feeds the drafter its own previous predictions,
x^j_i = FC(e(t_{i+1}), F^{j-1}_i), and the query at i sees what it would see as the j-th draft token of a tree
rooted at p = i - j + 1: target-feature keys x^1 at positions <= p, and the drafted keys x^k at position p + k - 1
for k = 2..j (itself included). With a stock decoder layer this is one forward over the concatenated steps
[x^1; ...; x^j] (positions repeated) with that 4D mask; outputs of earlier steps are recomputed identically.
Every step is trained with EAGLE's loss plus harmonized objective distillation (Top-K loss):
    L_topK = - sum_{x in top-K of p_target} p_target(x) log q_draft(x),  K = 10, weight 0.5 (slides' ablation optimum).
The step losses are averaged. Gradients flow through the previous steps' predictions, so memory grows with n
(what Beagle's training-memory comparison measures).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.distill import soft_ce, teacher_probs
from drafters.eagle import EagleDrafter


def harmonized_mask(length: int, steps: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, steps*L, steps*L] over the concatenated steps (row/col s*L + i = step s+1, position i)."""
    i = torch.arange(length, device=device)
    allowed = torch.zeros(steps * length, steps * length, dtype=torch.bool, device=device)
    for s in range(steps):  # query step j = s + 1
        rows = s * length + i
        p = i - s  # the root of the simulated tree
        allowed[rows[:, None], i[None, :]] = i[None, :] <= p[:, None]  # target-feature keys up to the root
        for k in range(1, s + 1):  # drafted keys x^{k+1} at position p + k
            col = p + k
            ok = col >= 0
            allowed[rows[ok], k * length + col[ok]] = True
    mask = torch.zeros(1, 1, steps * length, steps * length, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def harmonized_inputs(emb: torch.Tensor, feats: list[torch.Tensor], pad: torch.Tensor):
    """The concatenated-steps forward for step j = len(feats): (emb [B, jn, H], feat [B, jn, H], positions [B, jn],
    additive mask [B, 1, jn, jn])."""
    b, n, _ = emb.shape
    j = len(feats)
    pos = torch.arange(n, device=emb.device).repeat(j)[None].expand(b, -1)
    mask = harmonized_mask(n, j, emb.dtype, emb.device).expand(b, -1, -1, -1)
    mask = mask.masked_fill((pad.repeat(1, j) == 0)[:, None, None, :], torch.finfo(emb.dtype).min)
    return emb.repeat(1, j, 1), torch.cat(feats, dim=1), pos, mask


def next_step_input(feat0: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Step j+1 reads F^j_i, step j's output at position i-1 (position 0 keeps the target feature)."""
    return torch.cat([feat0[:, :1], pred[:, :-1]], dim=1)


def harmonized_steps(module, emb: torch.Tensor, feat0: torch.Tensor, pad: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """emb = e(t_{i+1}) [B, n, H], feat0 = f_i [B, n, H], pad [B, n] (1 = real) -> F^j_{i+1} for j = 1..steps."""
    n = emb.shape[1]
    feats, preds = [feat0], []
    for j in range(1, steps + 1):
        e, f, pos, mask = harmonized_inputs(emb, feats, pad)
        preds.append(module(e, f, position_ids=pos, attention_mask=mask)[:, (j - 1) * n :])
        feats.append(next_step_input(feat0, preds[-1]))
    return preds


class HassDrafter(EagleDrafter):
    name = "hass"
    w_reg = 1.0  # EAGLE's weights; CORAL halves w_reg

    @classmethod
    def build_module(cls, target, steps: int = 3, topk: int = 10, topk_weight: float = 0.5):
        head = super().build_module(target)
        head.steps, head.topk, head.topk_weight = steps, topk, topk_weight
        return head

    @classmethod
    def step_losses(cls, module, batch, target):
        """Per-step EAGLE + Top-K losses, averaged over the n steps. Returns (loss, parts, masked predictions
        [F^j at loss positions, each [M, H]], the targets f [M, H])."""
        head = getattr(module, "module", module)
        emb = target.decoder.embed_tokens(batch.input_ids[:, 1:])  # e(t_{i+1}) [B, n, H]
        mask_tok = batch.loss_mask[:, 2:].bool()  # F_{i+1} -> predicts t_{i+2}
        true = batch.hidden[:, 1:-1][mask_tok]  # [M, H]
        p = teacher_probs(target, true)  # [M, V]
        top_p, top_idx = p.topk(head.topk, dim=-1)
        loss, parts, preds = 0.0, {}, []
        steps = harmonized_steps(module, emb, batch.hidden_in[:, :-1], batch.attn_mask[:, 1:], head.steps)
        for j, pred_all in enumerate(steps, 1):
            pred = pred_all[:, :-1][mask_tok]
            preds.append(pred)
            reg = F.smooth_l1_loss(pred, true, reduction="none").mean(-1).mean()
            logq = target.lm_head(pred.to(target.dtype)).float().log_softmax(-1)
            cls_loss = soft_ce(p, logq)
            topk_loss = -(top_p * logq.gather(-1, top_idx)).sum(-1).mean()
            loss = loss + (cls.w_reg * reg + cls.w_cls * cls_loss + head.topk_weight * topk_loss) / head.steps
            parts[f"reg{j}"], parts[f"top{j}"] = reg.item(), topk_loss.item()
        return loss, parts, preds, true

    @classmethod
    def training_loss(cls, module, batch, target):
        loss, parts, _, _ = cls.step_losses(module, batch, target)
        return loss, parts
