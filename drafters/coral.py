"""CORAL (Weng et al., papers/003): HASS-style multi-step training plus Cross-Step Representation Alignment (`coral`),
and the LM-head router trained in a second stage on the frozen CORAL head (`coral_router`). EAGLE head and
EAGLE-2 tree at decoding time, like HASS.

CSRA (Sec. 3.1, Eq. 2-3). Training runs HASS's n harmonized steps as the authors' HASS code does (each step its own
graph, the previous steps' predictions detached, backpropagated step by step, step losses summed). At step j the
output features F^j at every loss position i are the anchors; the features that exist at step j are the outputs of
steps 1..j and the target's f (Z, "all features along with the targets"); an anchor's positive views P(z) are the j
other views of its own position (F^1_i .. F^{j-1}_i and f_i); every other feature in Z is a negative. With
L2-normalised features and cosine similarity,
    L_CSRA^j = mean over anchors z of  -log( sum_{z+ in P(z)} exp(z.z+/tau) / sum_{z' in Z \\ {z}} exp(z.z'/tau) ),
tau = 0.07 (App. A). Eq. 3, per step: L^j = w_reg L_reg + w_cls L_cls + w_csra L_CSRA^j with w_reg = 0.5 (half of
EAGLE's), w_cls = 0.1 (EAGLE's); no HASS Top-K term (Eq. 3 has none). App. A sets w_csra per target so that
w_csra L_CSRA ~ w_reg L_reg; conf/drafter/coral.yaml records the value measured that way here
(scripts/csra_weight.py). The earlier steps' views enter step j's loss detached (their graphs were already
backpropagated), so CSRA's gradient reaches step j's anchors only. `csra_views: graph` keeps every step's graph
instead and backpropagates the summed L^1 + ... + L^n once, so that L_CSRA^j's gradient also reaches the earlier
steps' views through their own graphs (n graphs held at once: more memory, the same forwards).

LM-head router (Sec. 3.3, Eq. 7-9). The vocabulary is split into N equal contiguous groups (token ids, so BPE's
frequent low ids share groups; App. D); a router r = softmax(W h) [N] (Eq. 7: one linear layer on the draft
feature h) picks the top-k groups; q(x) = r_g(x) * softmax(logits within g(x))[x] for x in an active group, 0
elsewhere (Eq. 8). Only the active groups' rows of the LM head are multiplied. Router loss (Eq. 9): cross-entropy
against the target's probability mass per group, sum_{x in g} p(x); trained in a second stage on the frozen CORAL head
(the head runs its n harmonized steps so the router sees the features it meets while drafting). Paper: N=16, top-2.
Drafting stays lossless: the router only changes which tokens are proposed; verification is the engine's.

Deviations (CORAL names no code of its own; docs/drafters.md): the earlier views enter CSRA detached (above,
`csra_views: graph` trains the other reading); Eq. 2's
positives enter as one sum inside the log; training attention is additive (HASS's `authors` form is HASS's option
only); the budget's peak lr 3e-4 and cosine (the paper trains at 3e-5, as EAGLE and HASS do).
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafters.distill import teacher_probs
from drafters.eagle import EagleOptions, trained_positions
from drafters.hass import HassDrafter, harmonized_inputs, harmonized_steps, next_step_input


def csra_loss(anchors: torch.Tensor, views: list[torch.Tensor], temperature: float) -> torch.Tensor:
    """Eq. 2 at one step. anchors [M, H]: the current step's outputs at M loss positions; views: the other features
    that exist at this step, each [M, H] at the same positions (the earlier steps' outputs, the targets)."""
    z = F.normalize(torch.cat([anchors, *views]).float(), dim=-1)  # Z: [(1 + len(views)) M, H], anchors first
    m = anchors.shape[0]
    sim = (z[:m] @ z.T) / temperature  # [M, (1 + len(views)) M]
    rows = torch.arange(m, device=z.device)
    sim[rows, rows] = float("-inf")  # z is not in Z \ {z}
    positive = (torch.arange(z.shape[0], device=z.device) % m)[None] == rows[:, None]  # same position, another view
    positive[rows, rows] = False
    return (sim.logsumexp(-1) - sim.masked_fill(~positive, float("-inf")).logsumexp(-1)).mean()


CSRA_VIEWS = ("detached", "graph")


@dataclass
class CoralOptions(EagleOptions):  # Eq. 3 has no Top-K term: none of HASS's Top-K options
    steps: int = 3  # the aligned steps n, as HASS's
    csra_weight: float = 0.06  # w_csra (App. A: set so that w_csra L_CSRA ~ w_reg L_reg; scripts/csra_weight.py)
    temperature: float = 0.07  # tau (App. A)
    csra_views: str = "detached"  # detached: step by step, earlier views detached; graph: one summed graph (above)

    def __post_init__(self):
        super().__post_init__()
        if self.csra_views not in CSRA_VIEWS:  # fails when the options are read, before any work
            raise ValueError(f"coral csra_views={self.csra_views!r} is not one of {', '.join(CSRA_VIEWS)}")


class CoralDrafter(HassDrafter):
    name = "coral"
    Options = CoralOptions
    w_reg = 0.5  # App. A: half of EAGLE's regression weight

    @classmethod
    def restarts(cls, opts):
        return ()  # one stage (HASS's Top-K restart is not CORAL's)

    @classmethod
    def training_steps(cls, module, batch, target, opts: CoralOptions, epoch: int,
                       progress: float = 0.0) -> Iterator[tuple[torch.Tensor, dict[str, float]]]:
        del epoch, progress  # one objective throughout
        graph = opts.csra_views == "graph"
        emb, mask_tok, true, p = cls.step_targets(batch, target, opts.loss_mask)
        earlier: list[torch.Tensor] = []  # F^1 .. F^{j-1} at the loss positions (detached unless `graph`)
        total, logged = None, {}  # `graph`: the summed L^j and their parts, yielded once after step n
        steps = harmonized_steps(module, emb, batch.hidden_in[:, :-1], batch.attn_mask[:, 1:], opts.steps)
        for j, pred_all in enumerate(steps, 1):
            pred = pred_all[mask_tok]  # [M, H]
            loss, parts = cls.step_loss(pred, true, p, target, topk=0, topk_weight=0.0)
            csra = csra_loss(pred, [*earlier, true], opts.temperature)
            earlier.append(pred if graph else pred.detach())
            piece, part = loss + opts.csra_weight * csra, {f"reg{j}": parts["reg"], f"csra{j}": csra.item()}
            if not graph:
                yield piece, part
                continue
            total, logged = piece if total is None else total + piece, {**logged, **part}
        if graph:
            yield total, logged


ROUTINGS = ("grouped", "masked")


def sync_free_groups(device: torch.device, dtype: torch.dtype, hidden: int, group_size: int) -> bool:
    """Whether F.grouped_mm runs on `device` without a host round trip: on the CPU ATen loops over the groups reading
    their offsets from the same memory (no device to wait for); on CUDA its bf16 kernel (sm 9.x and 10.x) reads them
    on the device, while its fallback (other dtypes, other GPUs) copies them to the host, a sync at every tree level.
    Its operands' rows must start on 16 bytes (the hidden size; on CUDA the group's size too)."""
    if hidden * dtype.itemsize % 16:
        return False
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and dtype == torch.bfloat16 and group_size * dtype.itemsize % 16 == 0
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


@torch.library.custom_op("specbench::group_matmul", mutates_args=())
def group_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [P, H] rows sorted by group (group i's end at ends[i], int32 [N]) times their group's w [N, G, H] -> [P, G].
    An op of its own so that a compiled region holds it whole: grouped_mm's fake kernel takes bf16 only, where ATen
    runs it in any dtype on the CPU (the compiled tests' fp32)."""
    return F.grouped_mm(x, w.transpose(1, 2), offs=ends)


@group_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


class LMHeadRouter(nn.Module):
    """Eq. 7: group logits W h [..., N] for a vocabulary of `vocab` tokens in N contiguous groups."""

    def __init__(self, hidden: int, vocab: int, groups: int, active: int, routing: str = "grouped"):
        super().__init__()
        if not 1 <= active <= groups <= vocab:
            raise ValueError(f"router needs 1 <= active ({active}) <= groups ({groups}) <= vocab ({vocab})")
        if routing not in ROUTINGS:
            raise ValueError(f"drafter.module.routing={routing!r}: one of {', '.join(ROUTINGS)}")
        self.proj = nn.Linear(hidden, groups, bias=False)
        self.vocab, self.groups, self.active, self.routing = vocab, groups, active, routing
        self.group_size = -(-vocab // groups)  # the last group may be shorter
        # `grouped` through one grouped matmul (else the whole head, `masked`'s q): set by the drafter for its device
        # and dtype (sync_free_groups), decided outside a compiled region; the CPU's answer in fp32 by default
        self.grouped_mm = sync_free_groups(torch.device("cpu"), torch.float32, hidden, self.group_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)

    def by_group(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """x [..., V] -> [..., N, G]: the vocabulary's groups, the last group's missing entries `fill`."""
        pad = self.groups * self.group_size - x.shape[-1]
        return F.pad(x, (0, pad), value=fill).view(*x.shape[:-1], self.groups, self.group_size)

    def group_mass(self, p: torch.Tensor) -> torch.Tensor:
        """Eq. 9's target: probability mass per group. p [M, V] -> [M, N]."""
        return self.by_group(p, 0.0).sum(-1)

    def log_probs(self, weight: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """Eq. 8 over each row's top-`active` groups. weight [V, H] (the LM head's), f [..., H] -> log q [..., V]
        (-inf outside the row's active groups). `grouped` multiplies only the active groups' rows of the LM head (the
        paper's saving), `masked` the whole head in one matmul, keeping the active groups (the same q). Neither reads
        the device: fixed shapes, so a tree grows in one compiled region either way."""
        shape, f = f.shape, f.reshape(-1, f.shape[-1])
        log_r = self.proj(f.to(self.proj.weight.dtype)).float().log_softmax(-1)  # [R, N]
        top = log_r.topk(self.active, dim=-1).indices  # [R, k]
        route = self._masked if self.routing == "masked" else self._grouped
        return route(weight, f, log_r, top).reshape(*shape[:-1], self.vocab)

    def _grouped(self, weight: torch.Tensor, f: torch.Tensor, log_r: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """log q [R, V] from the active groups' rows only: the R k (row, group) pairs sorted by group, each group's
        rows times its LM-head rows in one grouped matmul (group_matmul, its group offsets on the device), the
        in-group log-softmax, + log r_g, scattered back into a -inf [R, V]. The same per-group products (the same
        rows in the same order against the same weight rows) as when each group's rows were read on the host."""
        if not self.grouped_mm:  # no grouped matmul without a sync on this device: the whole head, the same q
            return self._masked(weight, f, log_r, top)
        r, k, n, g = f.shape[0], self.active, self.groups, self.group_size
        pad = n * g - self.vocab  # a last group shorter than G: the head padded, a copy at every call (the vocabularies
        # here divide by N: 49152, Llama 3's 128256 and Qwen2.5's 152064 by 16, so theirs is a view)
        w = (weight if pad == 0 else F.pad(weight, (0, 0, 0, pad))).reshape(n, g, -1)  # [N, G, H]
        pair_group = top.reshape(-1)  # [P = R k]: pair p is row p // k's (p % k)-th group
        order = pair_group.argsort(stable=True)  # [P] pairs by group, rows ascending within a group
        rows, groups = order.div(k, rounding_mode="floor"), pair_group[order]  # [P] each
        ends = torch.zeros(n, dtype=torch.int32, device=f.device).scatter_add_(
            0, pair_group, torch.ones_like(pair_group, dtype=torch.int32)).cumsum(0, dtype=torch.int32)  # [N]
        logits = group_matmul(f.to(weight.dtype)[rows], w, ends).float()  # [P, G]: each pair's group's head rows
        col = groups[:, None] * g + torch.arange(g, device=f.device)  # [P, G] each pair's token ids (padded: >= V)
        inner = logits.masked_fill(col >= self.vocab, float("-inf")).log_softmax(-1)  # the padding out of the softmax
        out = torch.full((r, n * g), float("-inf"), device=f.device)
        out[rows[:, None], col] = inner + log_r[rows, groups][:, None]  # (row, token) pairs are distinct
        return out[:, : self.vocab]

    def _masked(self, weight: torch.Tensor, f: torch.Tensor, log_r: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """log q [R, V] from the whole LM head: per group log r_g + the in-group log-softmax, -inf where not active."""
        r = f.shape[0]
        logits = F.linear(f.to(weight.dtype), weight).float()  # [R, V]
        inner = self.by_group(logits, float("-inf")).log_softmax(-1)  # the last group's missing rows out of its softmax
        active = torch.zeros_like(log_r, dtype=torch.bool).scatter_(1, top, True)  # [R, N]
        out = torch.where(active[..., None], inner + log_r[..., None], float("-inf"))  # [R, N, G]
        return out.view(r, -1)[:, : self.vocab]


@dataclass
class CoralRouterOptions:
    base: str | None = None  # the trained stage-1 CORAL head (training only: the router checkpoint holds it too)
    groups: int = 16  # N vocabulary groups (paper's best: 16)
    active: int = 2  # top-k groups active while drafting (paper's best: 2)
    routing: str = "grouped"  # decoding only: grouped (the active groups' head rows) | masked (LMHeadRouter.log_probs)


@functools.lru_cache(maxsize=8)
def _trained_options(base: str | None) -> CoralOptions:
    """CORAL's options as `base`'s checkpoint records them (read once, not at every training step)."""
    from specbench.decode.checkpoints import read_meta

    return CoralDrafter.options(read_meta(base).get("module", {}) if base else {})


class CoralRouterDrafter(CoralDrafter):
    """`coral_router`: the frozen CORAL head (stage 1, `base`) plus a trained LM-head router (stage 2)."""

    name = "coral_router"
    Options = CoralRouterOptions
    prunable = False  # the router already restricts the LM head to its active groups (module.draft_vocab refused)

    @staticmethod
    def head_options(opts: CoralRouterOptions) -> CoralOptions:
        """The stage-1 head's options: those `base` was trained with (its record), or CORAL's defaults."""
        return _trained_options(opts.base)

    @classmethod
    def build_module(cls, target, opts: CoralRouterOptions):
        from specbench.decode.checkpoints import load_checkpoint

        head = CoralDrafter.build_module(target, cls.head_options(opts))
        if opts.base:  # training: start from the trained stage-1 head
            load_checkpoint(opts.base, head, target, CoralDrafter.name)
        head.requires_grad_(False)  # stage 2 trains the router only
        head.router = LMHeadRouter(target.hidden_size, target.lm_head.weight.shape[0], opts.groups, opts.active,
                                   opts.routing)
        weight = target.lm_head.weight
        head.router.grouped_mm = sync_free_groups(weight.device, weight.dtype, weight.shape[1], head.router.group_size)
        return head.to(target.device)

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        # the router checkpoint holds the head's weights too: the stage-1 `base` is not needed to decode; `routing`
        # counts only when not the default (runs made before the option keep their names)
        return {k: v for k, v in options.items() if k != "base" and not (k == "routing" and v == "grouped")}

    @staticmethod
    def draft_logits(head, lm_head, f):
        return head.router.log_probs(lm_head.weight, f)

    @classmethod
    def training_steps(cls, module, batch, target, opts: CoralRouterOptions, epoch: int, progress: float = 0.0):
        del epoch, progress  # stage 2 is one graph: the router's loss over the frozen head's n steps
        yield cls.training_loss(module, batch, target, opts)

    @classmethod
    def training_loss(cls, module, batch, target, opts: CoralRouterOptions):
        head_opts = cls.head_options(opts)
        head, steps = module, head_opts.steps  # the router sees the head's own n steps
        emb = target.decoder.embed_tokens(batch.input_ids[:, 1:])
        feat0, pad = batch.hidden[:, :-1], batch.attn_mask[:, 1:]
        mask_tok = trained_positions(batch.loss_mask, batch.attn_mask, head_opts.loss_mask)  # as its head trained
        with torch.no_grad():  # the frozen head's own features for steps 1 .. n-1, as while drafting
            feats = [feat0]
            if steps > 1:
                feats += [next_step_input(feat0, p) for p in harmonized_steps(head, emb, feat0, pad, steps - 1)]
            p = teacher_probs(target, batch.hidden[:, 1:][mask_tok])  # [M, V]
            mass = head.router.group_mass(p)  # [M, N]
        e, f, pos, mask, _ = harmonized_inputs(emb, feats, pad)
        _, logits = module(e, f, position_ids=pos, attention_mask=mask, route=True)  # [B, n*T, N]
        n = emb.shape[1]
        loss, parts = 0.0, {}
        for j in range(steps):
            logr = logits[:, j * n : (j + 1) * n][mask_tok].float().log_softmax(-1)
            step = -(mass * logr).sum(-1).mean()
            loss = loss + step / steps
            hit = (logr.topk(head.router.active, -1).indices == mass.argmax(-1, keepdim=True)).any(-1)
            parts[f"router{j + 1}"], parts[f"hit{j + 1}"] = step.item(), hit.float().mean().item()
        return loss, parts
