"""Typed objects passed between the engine and drafters (shapes in comments; B is the batch axis, runs use B=1).

Vocabulary (vLLM / SpecInfer): a drafted node is *accepted* when verification keeps it; after the accepted path the
engine always emits one more token from the target, the *bonus* token when the path ended at a leaf of the draft
tree, or the *recovered* token when every child of the last accepted node was rejected (sampled from the residual).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target (and a sampling drafter's q) turn logits into a distribution. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class DraftTree:
    """What a drafter proposes for one step. Nodes are in topological order (parents[b, i] < i).

    A chain is the tree whose parents are [-1, 0, 1, ..., N-2]; an empty tree (N=0) is autoregressive decoding.
    """

    tokens: torch.Tensor  # [B, N] int64 drafted token ids
    parents: torch.Tensor  # [B, N] int64, -1 = the root (the last verified token, not yet in the target cache)
    draft_probs: torch.Tensor | None = None  # [B, N, V] q that node i was sampled from; None = deterministic (q=1)
    is_chain: bool = False  # parents are [-1, 0, ..., N-2], known without reading them: verified with the causal mask
    # [B, N] the policy's preference (higher first; a node never above its parent): the best n nodes form the tree
    # that policy grows with n nodes; read only by the tree cost model (specbench/bench/costmodel.py), None = node order
    priority: torch.Tensor | None = None


    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int = 1, device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return DraftTree(tokens=z, parents=z.clone(), is_chain=True)

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """tokens: [B, N] drafted one after another."""
        b, n = tokens.shape
        parents = torch.arange(-1, n - 1, device=tokens.device).expand(b, n).clone()
        return DraftTree(tokens=tokens, parents=parents, draft_probs=draft_probs, is_chain=True)


@dataclass
class TargetState:
    """What a drafter may read of the target after prefill or a verification step. Read-only for drafters.

    The target's cache holds every verified token except the last one, `tokens[:, -1]` (the root of the next tree):
    it is fed to the target together with the next tree.
    """

    tokens: torch.Tensor  # [B, T] every verified token: prompt + generated so far; tokens[:, -1] is the root
    hidden: torch.Tensor | None  # [B, n, H] target last hidden states of the n tokens just written to its cache,
    #                              i.e. of tokens[:, T-1-n : T-1] (the prompt at prefill; root + accepted path after a step)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer (K, V) [B, kv_heads, T-1, head_dim], the target cache
    layers: torch.Tensor | None = None  # [B, n, k*H] the inputs of the drafter's `hidden_layers` (EAGLE-3's
    #                                    low/middle/high features), rows as `hidden`'s; only for drafters needing LAYERS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # the run's RNG, for drafters that sample at T>0
    capacity: int = 0  # positions this generation can reach (prompt + budget + a tree; 0: not said), context or not

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def cache_positions(self) -> int:
        """Positions a drafter's own cache is sized to: the target cache's, so that neither reallocates inside the
        generation (a state built without one, in tests: the tokens so far + 1024)."""
        return self.capacity or self.num_tokens + 1024


@dataclass
class VerifyResult:
    """The outcome of verifying one DraftTree (batch index b of the step)."""

    accepted_nodes: list[int]  # indices into the tree's nodes, root-to-leaf order (len A, 0 <= A <= depth)
    accepted_tokens: list[int]  # [A] their token ids
    next_token: int  # the bonus or recovered token
    recovered: bool  # True: next_token was sampled from the residual after rejecting a child; False: bonus
    num_nodes: int  # N, the size of the tree that was verified
    emitted: list[int] = field(default_factory=list)  # tokens actually appended (accepted + next, cut at EOS / max)
    hidden: torch.Tensor | None = None  # [B, A+1, H] target last hidden states of the root and the accepted nodes
    #                                     (None unless the drafter declares needs "hidden")

    @property
    def accept_length(self) -> int:
        return len(self.accepted_nodes)
