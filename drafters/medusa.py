"""Medusa-1 (Cai et al. 2024; papers/001): K extra decoding heads on the frozen target's last hidden state.

Head k (k = 1..K): h~ = SiLU(W1_k h_t) + h_t with W1_k initialised to 0, then p_t^(k) = softmax(W2 h~), predicting
token y_{t+k+1} (the target's own LM head predicts y_{t+1}). Loss (Medusa-1, frozen backbone):
    L = sum_k lambda_k * CE(p_t^(k), y_{t+k+1}),  lambda_k = decay^k (decay 0.8).
With `labels: target` (self-distillation, the Medusa paper's recipe when the training text is not the model's own)
the CE is taken against the target's own next-token distribution at y_{t+k+1}'s position, softmax(LMHead(h_{t+k})),
instead of the one-hot ground-truth token; the features already hold h_{t+k}, so this costs no generation.
`MedusaOptions.labels` defaults to `ground_truth` (the authors' Medusa-1 training on ShareGPT's tokens); the YAML sets
`target`, which docs/drafters.md lists as a deviation: ShareGPT is not SmolLM2's own text.
Deviations from the paper / the authors' Medusa-1 command: all heads share the target's frozen LM head as W2 (a separate 49,152 x 576 head per
Medusa head would be 28M parameters each on the embedded target); only the W1_k are trained. The loss weights are
the paper's 0.8^k (their `train_legacy.py` sums the heads' CE unweighted), the warm-up is the budget's 20 steps (their
command: 10% of the steps).

Decoding: in our engine the root x_t has not been through the target yet, so the heads read h_{t-1} (the last
hidden state the engine handed over), whose head k predicts x_{t+k}, i.e. tree depth k. Candidates form a sparse
static tree of top-index paths (`tree`, as Medusa's sparse trees), or with `tree: auto` the sparse tree of `tree_nodes`
nodes chosen from the heads' top-k accuracies that validation measured on held-out target answers (Medusa's
"optimized sparse tree", drafters/trees.py: paths_from_accuracies). Candidates are deterministic (q = None), so
verification is lossless at any temperature. Medusa's typical acceptance (lossy) is not offered.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specbench.decode.drafter import HIDDEN, OwnTree, RowsDrafter, TrainableDrafter, chain_paths
from drafters.distill import soft_ce, teacher_probs
from drafters.trees import list_order, paths_from_accuracies, sorted_paths
from specbench.decode.checkpoints import check_keys, resolve
from specbench.errors import SpecbenchError
from specbench.decode.tree import is_chain
from specbench.decode.types import DraftTree, TargetState


# The sparse tree Medusa's authors decode their published 7B heads with (FasterDecoding/Medusa
# medusa/model/medusa_choices.py `mc_sim_7b_63`, the default of their MedusaModel; copied exactly, 63 paths of top-k
# ranks per head). Used for `tree: auto` with a checkpoint in their layout, which has no measured accuracies.
MEDUSA_MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1], [5],
    [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0],
    [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2],
    [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]


class MedusaHeads(nn.Module):
    """K residual blocks; with `vocab`, each head also has its own LM head W2_k (the paper's layout, as the published
    heads ship it: decoding only); without, they share the target's frozen LM head (trained here)."""

    def __init__(self, hidden_size: int, num_heads: int, vocab: int | None = None):
        super().__init__()
        self.w1 = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for lin in self.w1:  # W1 = 0: every head starts as the target's own next-token head
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.w2 = nn.ModuleList(nn.Linear(hidden_size, vocab, bias=False) for _ in range(num_heads)) if vocab else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> per-head features [..., K, H] (to be fed to the LM head)."""
        return torch.stack([h + F.silu(w(h)) for w in self.w1], dim=-2)

    def logits(self, h: torch.Tensor, shared_lm_head: nn.Module) -> torch.Tensor:
        """h [..., H] -> per-head next-token logits [..., K, V]: each head's own W2_k, or the shared LM head."""
        feats = self(h)
        if self.w2 is None:
            return shared_lm_head(feats.to(shared_lm_head.weight.dtype))
        return torch.stack([w2(feats[..., k, :].to(w2.weight.dtype)) for k, w2 in enumerate(self.w2)], dim=-2)


def load_authors_medusa(path: Path, target) -> MedusaHeads:
    """Medusa-1 as FasterDecoding/Medusa publishes it: `medusa_lm_head.pt` with keys `{i}.0.linear.{weight,bias}` (the
    residual block) and `{i}.1.weight` (head i's own LM head, vocab x hidden). The number of heads is counted from the
    tensors (the published config may say fewer). Each misfit is one line."""
    state = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    heads = sorted({int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()})
    if not heads or heads != list(range(len(heads))):
        raise SpecbenchError(f"checkpoint {path}: medusa_lm_head.pt holds no heads numbered 0..K-1 "
                             f"({sorted(state)[:3]})")
    check_keys(path, set(state), {f"{i}.{part}" for i in heads for part in ("0.linear.weight", "0.linear.bias",
                                                                           "1.weight")}, "Medusa heads")
    vocab, hidden = state["0.1.weight"].shape
    if (hidden, vocab) != (target.hidden_size, target.vocab_size):
        raise SpecbenchError(f"checkpoint {path} holds Medusa heads for hidden size {hidden} and vocabulary {vocab}; "
                             f"the target {target.name!r} has {target.hidden_size} and {target.vocab_size}")
    module = MedusaHeads(hidden, len(heads), vocab)
    with torch.no_grad():
        for i in heads:
            module.w1[i].weight.copy_(state[f"{i}.0.linear.weight"].float())
            module.w1[i].bias.copy_(state[f"{i}.0.linear.bias"].float())
            module.w2[i].weight.copy_(state[f"{i}.1.weight"].float())
    return module.to(target.device, target.dtype)  # the authors: medusa_head.to(base_model.dtype)


@dataclass
class MedusaOptions:
    num_heads: int = 4  # K heads
    decay: float = 0.8  # lambda_k = decay^k
    labels: str = "ground_truth"  # ground_truth (the paper's CE on the data's tokens) | target (self-distillation)

    def __post_init__(self):
        if self.labels not in ("ground_truth", "target"):
            raise SpecbenchError(f"medusa: labels={self.labels!r} is not one of ground_truth, target")


class MedusaDrafter(RowsDrafter, TrainableDrafter):
    name = "medusa"
    needs = frozenset({HIDDEN})
    Options = MedusaOptions

    ACC_RANKS = 10  # ranks per head whose accuracy validation measures (the widest tree `auto` can build)

    def __init__(self, target, checkpoint: str | None = None, module: dict | None = None,
                 tree: list[list[int]] | str | dict | None = None, tree_nodes: int = 19):
        self.heads = self.load_module(target, checkpoint, module)
        self.lm_head = target.lm_head  # the target's frozen LM head, shared (read only)
        k = len(self.heads.w1)
        given = tree
        tree = self.tree_paths(checkpoint, tree, tree_nodes) or chain_paths(k)  # default: the chain of top-1 heads
        self.paths, parents = sorted_paths(tree, max_depth=k)
        # what run.json records as the tree this run decoded with (`auto` resolves differently per checkpoint)
        name = "mc_sim_7b_63" if tree is MEDUSA_MC_SIM_7B_63 else "from the heads' accuracies" if given == "auto" else None
        self.tree_used = {"kind": "static", "paths": [list(p) for p in tree], **({"name": name} if name else {})}
        self.priority = torch.tensor([list_order(tree, self.paths)], device=target.device)  # the given order
        self.parents = torch.tensor([parents], device=target.device)
        self.is_chain = is_chain(parents)  # e.g. the default chain of top-1 heads: verified with the causal mask
        self.depth_idx = torch.tensor([len(p) - 1 for p in self.paths], device=target.device)
        self.rank_idx = torch.tensor([p[-1] for p in self.paths], device=target.device)
        self.topk = 1 + int(self.rank_idx.max())
        self.last_h: torch.Tensor | None = None  # [B, H] hidden state of the token before the root

    @classmethod
    def tree_paths(cls, checkpoint: str | None, tree, tree_nodes: int) -> list[list[int]] | None:
        """The paths the heads draft, in order of preference: a given list (or a conf/tree static dict), or for
        `auto` the sparse tree of `tree_nodes` nodes from the checkpoint's measured accuracies (published heads,
        which carry none: their authors' mc_sim_7b_63); None: the default chain."""
        if isinstance(tree, dict):
            if tree.get("kind") != "static":
                raise SpecbenchError(f"medusa: a tree dict must be a static list of top-rank paths, not {tree.get('kind')!r}")
            return [list(p) for p in tree["paths"]]
        if isinstance(tree, str):
            if tree != "auto":
                raise SpecbenchError(f"medusa: tree={tree!r} is neither a list of top-rank paths nor 'auto'")
            if checkpoint and (resolve(checkpoint) / "medusa_lm_head.pt").is_file():
                return MEDUSA_MC_SIM_7B_63  # published heads carry no measured accuracies: their authors' own tree
            return paths_from_accuracies(cls.measured_accuracies(checkpoint), tree_nodes)
        return [list(p) for p in tree] if tree else None

    @classmethod
    def own_tree(cls, spec: dict) -> OwnTree:
        """tree=auto cuts Medusa's own tree (the paper's sparse tree): its first n paths of depth <= d."""
        paths = cls.tree_paths(spec.get("checkpoint"), spec.get("tree"), int(spec.get("tree_nodes", 19)))
        paths = paths or chain_paths(cls.options(spec.get("module")).num_heads)
        return OwnTree({"kind": "static", "name": "medusa", "paths": paths}, lambda s, cut: {**s, "tree": cut["paths"]})

    # ---- training side -------------------------------------------------------------------------------------------
    @classmethod
    def load_published(cls, target, path: Path, options: dict) -> nn.Module | None:
        """Medusa-1 heads in their authors' layout (`medusa_lm_head.pt`)."""
        return load_authors_medusa(path, target) if (path / "medusa_lm_head.pt").is_file() else None

    @classmethod
    def build_module(cls, target, opts: MedusaOptions) -> MedusaHeads:
        return MedusaHeads(target.hidden_size, opts.num_heads).to(target.device)

    @classmethod
    def training_loss(cls, module, batch, target, opts: MedusaOptions):
        feats = module(batch.hidden_in)  # [B, T, K, H]
        k_heads = feats.shape[2]
        label_p = row_of = None
        if opts.labels == "target":  # one LM-head pass serves every head: y_{u+2}'s law is read off h_{u+1}
            keep = batch.loss_mask[:, 2:].bool()  # [B, T-2]: every label position some head is trained on
            label_p = teacher_probs(target, batch.hidden[:, 1:-1][keep])  # [M, V]
            with torch.no_grad():
                row_of = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
                row_of[keep] = torch.arange(int(keep.sum()), device=keep.device)
        loss, parts = 0.0, {}
        for k in range(1, k_heads + 1):  # head k reads h_t and predicts y_{t+k+1}
            mask = batch.loss_mask[:, k + 1 :].bool()
            logits = target.lm_head(feats[:, : -(k + 1), k - 1][mask].to(target.dtype)).float()
            if label_p is not None:  # y_{t+k+1} is label row u = t + k - 1
                ce = soft_ce(label_p[row_of[:, k - 1 :][:, : mask.shape[1]][mask]], logits.log_softmax(-1))
            else:
                ce = F.cross_entropy(logits, batch.input_ids[:, k + 1 :][mask])
            loss = loss + opts.decay**k * ce
            parts[f"ce{k}"] = ce.item()
        return loss, parts

    @classmethod
    @torch.no_grad()
    def chain_predict(cls, module, input_ids, hidden, positions, depth, target):
        idx = torch.tensor(positions, device=hidden.device) - 1  # the heads read h_{t-1} for root x_t
        preds = target.lm_head(module(hidden[idx]).to(target.dtype)).argmax(-1)  # [P, K]
        if depth > preds.shape[1]:
            preds = torch.cat([preds, preds.new_full((len(positions), depth - preds.shape[1]), -1)], dim=1)
        return preds[:, :depth]

    @classmethod
    @torch.no_grad()
    def validation_extras(cls, module, val, target) -> dict:
        """head_topk_acc[k-1][i]: how often head k's rank-i token is the target's token x_{t+k}, for every root x_t
        inside the held-out answers, the heads reading the target's own h_{t-1} as at decode time."""
        hits, count = None, 0
        for x in val:
            ids, hidden = x["input_ids"].to(target.device), x["hidden"].to(target.device)
            k = len(module.w1)
            first = max(int(x["loss_mask"].nonzero()[0]), 1)
            roots = torch.arange(first, len(ids) - k, device=ids.device)  # [P] roots with all K tokens after them
            if len(roots) == 0:
                continue
            logits = target.lm_head(module(hidden[roots - 1].float()).to(target.dtype))  # [P, K, V]
            top = logits.topk(cls.ACC_RANKS, dim=-1).indices  # [P, K, R]
            truth = ids[roots[:, None] + torch.arange(1, k + 1, device=ids.device)]  # [P, K]
            h = (top == truth[..., None]).sum(0)  # [K, R]
            hits, count = (h if hits is None else hits + h), count + len(roots)
        if hits is None:
            return {}
        return {"head_topk_acc": (hits.double() / count).tolist(), "head_acc_roots": count}

    @staticmethod
    def measured_accuracies(checkpoint: str | None) -> list[list[float]]:
        meta = resolve(checkpoint) / "config.json" if checkpoint else None
        acc = (json.loads(meta.read_text()).get("metrics", {}).get("head_topk_acc")
               if meta is not None and meta.is_file() else None)
        if not acc:
            raise SpecbenchError("medusa: tree=auto needs a checkpoint whose validation measured its heads' accuracies "
                                 f"({checkpoint}: none; give a tree, drafter.tree=[[0],[0,0],...], or retrain it with "
                                 "`python -m specbench.train drafter=medusa`)")
        return acc

    # ---- decoding side -------------------------------------------------------------------------------------------
    # every row of a batch (batch 1 included) drafts in the same head forward: the heads read each row's last hidden
    # state

    def prefill_rows(self, state: TargetState) -> None:
        self.last_h = state.fresh.last(state.hidden)  # [B, H] each row's last fresh hidden state

    @torch.inference_mode()
    def propose_rows(self, state: TargetState) -> DraftTree:
        logits = self.heads.logits(self.last_h, self.lm_head)  # [B, K, V]
        top = logits.topk(self.topk, dim=-1).indices  # [B, K, topk]
        tokens = top[:, self.depth_idx, self.rank_idx]  # [B, N]
        return DraftTree(tokens=tokens, parents=self.parents.expand(tokens.shape[0], -1), is_chain=self.is_chain,
                         priority=self.priority.expand(tokens.shape[0], -1))

    def on_verified_rows(self, state: TargetState) -> None:
        self.last_h = state.fresh.last(state.hidden)  # [B, H] each row's last fresh hidden state

    def keep_rows(self, leave) -> None:
        pass  # the next state (after the batch shrank) gives every row's hidden state afresh
