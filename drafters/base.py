"""The Drafter protocol: the drafter only proposes and observes; the engine owns the target, its cache and verification.

Lifecycle per generation (one prompt turn):
    drafter.prefill(state)            # after the target prefilled the prompt
    loop:
        tree = drafter.propose(state)  # a DraftTree (chain, static tree or dynamic tree)
        ...engine verifies...
        drafter.on_verified(result, state)  # roll back / extend the drafter's own cache

A drafter declares in `needs` which target outputs it reads from TargetState ("hidden": last hidden states,
"kv": the target's per-layer key/values). It never calls the target or touches the target's cache; reading the
target's frozen weights (embeddings, LM head) at construction is allowed and is how EAGLE-style drafters share them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from specbench.types import DraftTree, TargetState, VerifyResult

HIDDEN = "hidden"
KV = "kv"


class Drafter(ABC):
    needs: ClassVar[frozenset[str]] = frozenset()
    #: name recorded in results
    name: ClassVar[str] = "drafter"

    @abstractmethod
    def prefill(self, state: TargetState) -> None:
        """Start a new generation: state.tokens is the prompt plus the first generated token (the root)."""

    @abstractmethod
    def propose(self, state: TargetState) -> DraftTree:
        """Draft the next tree below state.tokens[:, -1]."""

    @abstractmethod
    def on_verified(self, result: VerifyResult, state: TargetState) -> None:
        """Observe what was kept: state.tokens now ends with the accepted tokens and the bonus/recovered token."""


class NoDrafter(Drafter):
    """The autoregressive baseline: the same engine with an empty tree, so every step is one target forward."""

    name = "none"

    def __init__(self, target: object = None):
        del target  # needs nothing from the target

    def prefill(self, state: TargetState) -> None:
        pass

    def propose(self, state: TargetState) -> DraftTree:
        return DraftTree.empty(state.tokens.shape[0], state.tokens.device)

    def on_verified(self, result: VerifyResult, state: TargetState) -> None:
        pass
