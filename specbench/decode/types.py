"""Typed objects passed between the engine and drafters (shapes in comments; B is the batch axis: the live rows of a
batch, ragged ones padded, their real extent given per row).

What a step's verification decided reaches a drafter through the next `TargetState` only, on the device where it can
stay there: `fresh[b]` (host and device) is row b's accepted nodes + 1 (root + accepted path, the entries just written
to the target cache), `tokens` ends with them and the bonus/recovered token. A drafter that needs a few host ints for
its next propose stages them (`Lookahead`, Drafter.lookahead_rows) so that they travel in the engine's one host read.

Vocabulary (vLLM / SpecInfer): a drafted node is *accepted* when verification keeps it; after the accepted path the
engine always emits one more token from the target, the *bonus* token when the path ended at a leaf of the draft
tree, or the *recovered* token when every child of the last accepted node was rejected (sampled from the residual).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbench.decode.rows import RowCounts


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
    # rows padded to one node count (a batch's trees): the real nodes of row b are its first sizes[b] (host ints),
    # valid[b, i] the same on the device (a padding node is a child of the root, never accepted); None: all N real
    sizes: list[int] | None = None
    valid: torch.Tensor | None = None  # [B, N] bool

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def row_sizes(self) -> list[int]:
        """Real nodes per row (host ints, no device read)."""
        return list(self.sizes) if self.sizes is not None else [self.num_nodes] * self.tokens.shape[0]

    def row(self, b: int) -> "DraftTree":
        """Row b's own tree, padding dropped (batch of one)."""
        n = self.row_sizes()[b]
        cut = lambda x: None if x is None else x[b : b + 1, :n]  # noqa: E731
        return DraftTree(tokens=cut(self.tokens), parents=cut(self.parents), draft_probs=cut(self.draft_probs),
                         is_chain=self.is_chain, priority=cut(self.priority))

    @staticmethod
    def stack(trees: list["DraftTree"]) -> "DraftTree":
        """Trees of one row each as the rows of one batch, padded to the largest node count (padding nodes: children
        of the root, token 0, q = 0, priority -inf); a batch of one is its tree as it is."""
        if len(trees) == 1:
            return trees[0]
        sizes = [t.num_nodes for t in trees]
        n, dev = max(sizes), trees[0].tokens.device

        def pad(xs: list[torch.Tensor], fill) -> torch.Tensor:  # each [1, n_b, ...] -> [B, n, ...]
            return torch.cat([torch.cat([x, x.new_full((1, n - x.shape[1], *x.shape[2:]), fill)], 1) for x in xs])
        probs = None
        if any(t.draft_probs is not None for t in trees):  # a row without q drafted nothing or deterministically
            v = next(t.draft_probs for t in trees if t.draft_probs is not None).shape[-1]
            probs = pad([t.draft_probs if t.draft_probs is not None else
                         torch.nn.functional.one_hot(t.tokens, v).float() for t in trees], 0.0)
        priority = None
        if all(t.priority is not None for t in trees):
            priority = pad([t.priority for t in trees], float("-inf"))
        valid = torch.cat([torch.cat([torch.ones(1, k, dtype=torch.bool, device=dev),
                                      torch.zeros(1, n - k, dtype=torch.bool, device=dev)], 1) for k in sizes])
        return DraftTree(tokens=pad([t.tokens for t in trees], 0), parents=pad([t.parents for t in trees], -1),
                         draft_probs=probs, is_chain=all(t.is_chain for t in trees) and len(set(sizes)) == 1,
                         priority=priority, sizes=sizes, valid=valid)

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
    # model.compile: the same cache's static buffers whole, per layer [bucket, kv_heads, capacity, head_dim] (shapes
    # that never change, for a drafter's compiled region; only for drafters needing KV); None otherwise
    kv_static: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    layers: torch.Tensor | None = None  # [B, n, k*H] the inputs of the drafter's `hidden_layers` (EAGLE-3's
    #                                    low/middle/high features), rows as `hidden`'s; only for drafters needing LAYERS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # the run's RNG, for drafters that sample at T>0
    capacity: int = 0  # positions this generation can reach (prompt + budget + a tree; 0: not said), context or not
    # the rows of a batch, ragged (every B, 1 included): row b's verified tokens are tokens[b, :lengths[b]], its hidden
    # rows hidden[b, :fresh[b]], its cached entries kv[..., :lengths[b] - 1, :], its RNG generators[b]. A state built
    # without them (a test, a caller of one row) has every row full: __post_init__ says so, so that a drafter reads
    # them at every B (fresh stays None without hidden rows or layers)
    lengths: RowCounts | None = None
    fresh: RowCounts | None = None
    generators: tuple[torch.Generator | None, ...] | None = None
    # what the drafter staged for this propose (Drafter.lookahead_rows), read with the engine's last host transfer;
    # None: it staged nothing (or the state was built by a caller that does not stage, a test)
    lookahead: "Lookahead | None" = None

    def __post_init__(self):
        if self.lengths is None:
            self.lengths = RowCounts.copy([self.num_tokens] * self.rows, self.tokens.device)
        if self.fresh is None and (self.hidden is not None or self.layers is not None):
            self.fresh = RowCounts.copy([self._fresh_width()] * self.rows, self.tokens.device)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def _fresh_width(self) -> int:
        """n: the hidden rows' (or, for a drafter reading only `layers`, the layers' rows') padded count."""
        return (self.hidden if self.hidden is not None else self.layers).shape[1]

    def fresh_tokens(self) -> torch.Tensor:
        """[B, n] each row's tokens of its hidden rows' entries shifted by one: row b's last fresh[b] verified tokens
        (the pairs (f_i, t_{i+1}) of EAGLE-style drafters), left-aligned as `hidden` (past fresh[b]: stale)."""
        n = self._fresh_width()
        cols = (self.lengths.dev - self.fresh.dev)[:, None] + torch.arange(n, device=self.tokens.device)
        return self.tokens.gather(1, cols.clamp(0, self.num_tokens - 1))

    def row(self, b: int) -> "TargetState":
        """What row b's drafter reads when it drafts that row alone (batch of one, its own lengths)."""
        t = self.lengths[b]
        f = self.fresh[b] if self.fresh is not None else None
        return TargetState(
            tokens=self.tokens[b : b + 1, :t],
            hidden=None if self.hidden is None else self.hidden[b : b + 1, :f],
            kv=None if self.kv is None else [(k[b : b + 1, :, : t - 1], v[b : b + 1, :, : t - 1]) for k, v in self.kv],
            layers=None if self.layers is None else self.layers[b : b + 1, :f],
            sampling=self.sampling,
            generator=self.generators[b] if self.generators is not None else self.generator,
            capacity=self.capacity,
        )

    @property
    def cache_positions(self) -> int:
        """Positions a drafter's own cache is sized to: the target cache's, so that neither reallocates inside the
        generation (a state built without one, in tests: the tokens so far + 1024)."""
        return self.capacity or self.num_tokens + 1024


@dataclass(frozen=True)
class Lookahead:
    """What a drafter prepares for its next propose while the engine finishes a step (Drafter.lookahead_rows): computed
    on the device from the verified tokens, before the step's one host read, which carries `counts` along, so that the
    drafter sizes its next tree without a read of its own (pld: each row's draft length and where its continuation
    starts). The engine keeps its rows in step with the batch (a leave reorders them like every other holder of rows)
    and hands it back in the next TargetState with `host` filled in."""

    counts: torch.Tensor  # [B] int64, on the device: joins the engine's host read
    data: torch.Tensor | None = None  # [B, ...] device only, kept with its rows (pld: each continuation's start)
    host: tuple[int, ...] | None = None  # [B] `counts` on the host; None until the engine's read

    def read(self, host: list[int]) -> "Lookahead":
        """The same with its counts read (the engine's transfer)."""
        return Lookahead(self.counts, self.data, tuple(host))

    def keep(self, leave) -> "Lookahead":
        """The rows a leave (specbench/decode/rows.py) keeps, in their new order."""
        return Lookahead(self.counts.index_select(0, leave.index_t),
                         None if self.data is None else self.data.index_select(0, leave.index_t),
                         None if self.host is None else tuple(self.host[i] for i in leave.index))
