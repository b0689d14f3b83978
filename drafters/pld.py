"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the latest n-gram's earlier occurrence.

The worked example of a drafter: no weights, no target outputs (`needs` is empty), deterministic (draft_probs=None,
so at T>0 the engine verifies each drafted token with q = 1). Matching follows transformers'
`prompt_lookup_num_tokens` (PromptLookupCandidateGenerator): n-gram sizes from `max_ngram` down to `min_ngram`, the
first (leftmost) earlier occurrence that has a continuation, `num_pred_tokens` tokens copied — so `make perf` compares
the two engines on the same drafts.
"""
from __future__ import annotations

import torch

from specbench.decode.drafter import Drafter, OwnTree, chain_paths
from specbench.decode.types import DraftTree, TargetState, VerifyResult


def lookup(tokens: torch.Tensor, max_ngram: int, min_ngram: int, num_pred: int, prefer: str = "first") -> torch.Tensor:
    """tokens [T] -> the continuation of an earlier occurrence of the trailing n-gram, [<= num_pred] (maybe empty)."""
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows starting at 0 .. length-n-1: every earlier n-gram whose continuation starts inside the context
        windows = tokens[: length - 1].unfold(0, n, 1)  # [length - n, n]
        hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[0 if prefer == "first" else -1]) + n
            return tokens[start : start + num_pred]
    return tokens[:0]


class PromptLookup(Drafter):
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

    def prefill(self, state: TargetState) -> None:
        pass

    def propose(self, state: TargetState) -> DraftTree:
        draft = lookup(state.tokens[0], self.max_ngram, self.min_ngram, self.num_pred_tokens, self.prefer)
        return DraftTree.chain(draft[None])

    def on_verified(self, result: VerifyResult, state: TargetState) -> None:
        pass  # stateless: the context is re-read at every step
