"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the latest n-gram's earlier occurrence.

The worked example of a drafter: no weights, no target outputs (`needs` is empty), deterministic (draft_probs=None,
so at T>0 the engine verifies each drafted token with q = 1). Matching follows transformers'
`prompt_lookup_num_tokens` (PromptLookupCandidateGenerator): n-gram sizes from `max_ngram` down to `min_ngram`, the
first (leftmost) earlier occurrence that has a continuation, `num_pred_tokens` tokens copied — so `make perf` compares
the two engines on the same drafts.

The lookup runs on the device, and its draft lengths (which size the next tree on the host) come back in the engine's
one host read per step: the drafter stages them (`lookahead_rows`, a `Lookahead` of each row's count and start) right
after a step's verified tokens are written, before that read, and finds them in the next state (`state.lookahead`).
So its lookup's time falls in the engine's verify phase (StepClock), its draft phase only gathers the tokens.
"""
from __future__ import annotations

import torch

from specbench.decode.drafter import Drafter, OwnTree, RowsDrafter, chain_paths
from specbench.decode.types import DraftTree, Lookahead, TargetState


def lookup_rows(tokens: torch.Tensor, lengths: torch.Tensor, max_ngram: int, min_ngram: int, num_pred: int,
                prefer: str = "first") -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's lookup at once, in tensor ops: row b's context is tokens[b, :lengths[b]] ([B, T] right-padded,
    lengths [B] on the device) -> (start [B], count [B]): the continuation tokens[b, start : start + count] of an
    earlier occurrence of the row's trailing n-gram (count 0: none), n from max_ngram down, the first (or last)
    occurrence whose continuation starts inside the context."""
    b, t = tokens.shape
    dev = tokens.device
    start = torch.zeros(b, dtype=torch.long, device=dev)
    have = torch.zeros(b, dtype=torch.bool, device=dev)
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        query = tokens.gather(1, (lengths[:, None] - n + torch.arange(n, device=dev)).clamp(min=0))  # [B, n]
        windows = tokens.unfold(1, n, 1)  # [B, T-n+1, n]: the window starting at s
        s = torch.arange(windows.shape[1], device=dev)
        # windows starting at 0 .. length-n-1: every earlier n-gram whose continuation starts inside the context
        hit = (windows == query[:, None, :]).all(-1) & (s[None, :] + n <= lengths[:, None] - 1)  # [B, S]
        if prefer == "first":
            at = torch.where(hit, s, windows.shape[1]).min(-1).values
        else:
            at = torch.where(hit, s, -1).max(-1).values
        found = hit.any(-1) & ~have & (lengths > n)
        start = torch.where(found, at + n, start)
        have = have | found
    count = torch.where(have, (lengths - start).clamp(min=0, max=num_pred), 0)
    return start, count


class PromptLookup(RowsDrafter, Drafter):
    name = "pld"

    def __init__(self, target: object = None, num_pred_tokens: int = 10, max_ngram: int = 2, min_ngram: int = 1,
                 prefer: str = "first"):
        del target  # reads nothing of the target
        if not 1 <= min_ngram <= max_ngram or num_pred_tokens < 1 or prefer not in ("first", "last"):
            raise ValueError("pld needs 1 <= min_ngram <= max_ngram, num_pred_tokens >= 1, prefer in {first, last}")
        self.num_pred_tokens, self.max_ngram, self.min_ngram, self.prefer = num_pred_tokens, max_ngram, min_ngram, prefer

    @classmethod
    def own_tree(cls, spec: dict) -> OwnTree:
        """tree=auto tunes the chain length: a lookup cut at n tokens drafts the first n of the same continuation."""
        n = int(spec.get("num_pred_tokens", 10))
        return OwnTree({"kind": "static", "name": f"prompt lookup, up to {n} tokens", "paths": chain_paths(n)},
                       lambda s, cut: {**s, "num_pred_tokens": len(cut["paths"])})

    # every row's lookup in one set of tensor ops on the device. It runs as soon as a step's verified tokens are there
    # (lookahead_rows, before the engine's host read), and its draft lengths travel in that read: no read of its own,
    # and a row without a match verifies its root alone (a tree as wide as its longest match, not num_pred_tokens)
    def prefill_rows(self, state: TargetState) -> None:
        pass

    def lookahead_rows(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Lookahead:
        start, count = lookup_rows(tokens, lengths, self.max_ngram, self.min_ngram, self.num_pred_tokens, self.prefer)
        return Lookahead(count, start)

    def propose_rows(self, state: TargetState) -> DraftTree:
        look = state.lookahead
        if look is None:  # a caller that stages nothing (a one-row wrapper, a test's state): the lookup and its read
            look = self.lookahead_rows(state.tokens, state.lengths.dev)
            look = look.read(look.counts.tolist())
        start, count, sizes = look.data, look.counts, list(look.host)
        n = max(sizes)
        cols = (start[:, None] + torch.arange(n, device=start.device)).clamp(max=state.tokens.shape[1] - 1)
        tokens = state.tokens.gather(1, cols)  # [B, n]
        tree = DraftTree.chain(tokens)
        tree.sizes, tree.valid = sizes, torch.arange(n, device=start.device)[None, :] < count[:, None]
        tree.is_chain = len(set(sizes)) == 1
        return tree

    def on_verified_rows(self, state: TargetState) -> None:
        pass  # stateless: the next lookup comes with the state (lookahead)

    def keep_rows(self, leave) -> None:
        pass  # (the engine reorders the staged lookup with the rows)
