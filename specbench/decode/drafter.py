"""The Drafter protocol: the drafter only proposes and observes; the engine owns the target, its cache and verification.

Lifecycle per generation (one prompt turn):
    drafter.prefill(state)            # after the target prefilled the prompt
    loop:
        tree = drafter.propose(state)  # a DraftTree (chain, static tree or dynamic tree)
        ...engine verifies...
        drafter.on_verified(state)  # roll back / extend the drafter's own cache

The engine drives every batch, batch 1 included, through the rows protocol: `prefill_rows`, `propose_rows` (one
DraftTree for all live rows, padded to one node count), `on_verified_rows` and `keep_rows` (finished rows leave).
Every shipped drafter implements it (`batched = True`): all rows in the same forwards. A drafter written for one row
only (the methods above) decodes at batch 1 (`OneRow`); at decoding.batch_size > 1 it is refused in one line.

What verification decided reaches the drafter through the next TargetState, on the device (`fresh`: each row's
accepted nodes + 1; `tokens`: the new ones appended); the engine reads nothing else of a step for it. A drafter that
needs host ints to size its next tree (pld's draft lengths) stages them in `lookahead_rows`, which runs on the device
before the engine's one host read of the step and travels in it (TargetState.lookahead), so that every drafter holds
to one host read per step.

A drafter declares in `needs` which target outputs it reads from TargetState ("hidden": last hidden states,
"kv": the target's per-layer key/values, "layers": the inputs of the target layers it lists in `hidden_layers`,
EAGLE-3's low/middle/high features). It never calls the target or touches the target's cache; reading the
target's frozen weights (embeddings, LM head) at construction is allowed and is how EAGLE-style drafters share them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from specbench.decode.rows import Leave

from specbench.decode.types import DraftTree, Lookahead, TargetState

HIDDEN = "hidden"
KV = "kv"
LAYERS = "layers"


class Drafter(ABC):
    needs: ClassVar[frozenset[str]] = frozenset()
    #: with LAYERS in needs: the hidden_states indices (HF's: i = the input of layer i) the target returns for it
    hidden_layers: tuple[int, ...] = ()
    #: name recorded in results
    name: ClassVar[str] = "drafter"

    @abstractmethod
    def prefill(self, state: TargetState) -> None:
        """Start a new generation: state.tokens is the prompt plus the first generated token (the root)."""

    @abstractmethod
    def propose(self, state: TargetState) -> DraftTree:
        """Draft the next tree below state.tokens[:, -1]."""

    @abstractmethod
    def on_verified(self, state: TargetState) -> None:
        """Observe what was kept: state.tokens now ends with the accepted tokens and the bonus/recovered token
        (state.fresh[0] - 1 of them accepted)."""

    #: implements the rows protocol below itself (all live rows of a batch in one call); else it decodes one row
    #: (batch 1) through OneRow
    batched: ClassVar[bool] = False

    def prefill_rows(self, state: TargetState) -> None:
        """Start a generation for every row of `state` (ragged rows: state.lengths, state.fresh)."""
        raise NotImplementedError(f"{type(self).__name__} drafts one row at a time (batched = False)")

    def propose_rows(self, state: TargetState) -> DraftTree:
        """Every live row's tree, [A, N] padded (DraftTree.sizes / valid)."""
        raise NotImplementedError(f"{type(self).__name__} drafts one row at a time (batched = False)")

    def on_verified_rows(self, state: TargetState) -> None:
        """Observe every live row's outcome: row r accepted state.fresh[r] - 1 nodes (host and device), state.tokens
        ends with them and the bonus/recovered token."""
        raise NotImplementedError(f"{type(self).__name__} drafts one row at a time (batched = False)")

    def lookahead_rows(self, tokens: "torch.Tensor", lengths: "torch.Tensor") -> Lookahead | None:
        """Stage what the next propose needs on the host, from the verified tokens alone: called after the prefill and
        after every step, once the new tokens are on the device and before the engine's host read (before
        on_verified_rows), with tokens [B, W] (row b's verified tokens tokens[b, :lengths[b]], past them stale) and
        lengths [B] on the device. Tensor ops only (no host read): the returned counts travel in the engine's read and
        come back as the next state's `lookahead`. None (the default): nothing to stage."""
        del tokens, lengths
        return None

    def keep_rows(self, leave: "Leave") -> None:
        """Rows left the batch: new row r is old row leave.index[r] (specbench/decode/rows.py)."""
        raise NotImplementedError(f"{type(self).__name__} drafts one row at a time (batched = False)")

    @classmethod
    def own_tree(cls, spec: dict) -> "OwnTree | None":
        """For tree=auto on a drafter that does not read a conf/tree policy (its `tree` is not ${tree}): its paper's
        drafts as a static conf/tree dict whose first n paths of depth <= d are what it drafts when cut there, and the
        constructor arguments that make it draft such a cut. None: nothing to tune this way (tree drafters are tuned
        through ${tree}; the baseline drafts nothing)."""
        del spec
        return None


class RowsDrafter:
    """A mixin for a drafter written for the rows protocol (put it before Drafter in the bases): its one-row methods
    are its rows methods at one row."""

    batched = True

    def prefill(self, state: TargetState) -> None:
        self.prefill_rows(state)

    def propose(self, state: TargetState) -> DraftTree:
        return self.propose_rows(state)

    def on_verified(self, state: TargetState) -> None:
        self.on_verified_rows(state)


class OneRow:
    """The rows protocol over a drafter written for one row (batched = False): batch 1 only, its one-row methods."""

    batched = True

    def __init__(self, drafter: "Drafter"):
        self.drafter = drafter

    def prefill_rows(self, state: TargetState) -> None:
        self.drafter.prefill(state)

    def propose_rows(self, state: TargetState) -> DraftTree:
        return DraftTree.stack([self.drafter.propose(state)])

    def on_verified_rows(self, state: TargetState) -> None:
        self.drafter.on_verified(state)

    def lookahead_rows(self, tokens: "torch.Tensor", lengths: "torch.Tensor") -> None:
        del tokens, lengths  # a one-row drafter stages nothing

    def keep_rows(self, leave: "Leave") -> None:
        raise AssertionError("a batch of one has no rows to keep")  # (the engine stops when its row is done)


def check_batched(drafter: "Drafter", rows: int) -> None:
    """A batch of several rows needs a drafter that drafts them together: one line, before any work."""
    if rows > 1 and not getattr(drafter, "batched", False):
        from specbench.errors import SpecbenchError

        raise SpecbenchError(f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} drafts one row at a time "
                             f"(batched = False, no rows protocol): decoding.batch_size={rows} needs one that "
                             f"implements prefill_rows / propose_rows / on_verified_rows / keep_rows; use 1")


def rows_protocol(drafter: "Drafter", rows: int):
    """What the engine drives a batch of `rows` through: the drafter itself if it is batched, else (batch 1) OneRow."""
    check_batched(drafter, rows)
    return drafter if getattr(drafter, "batched", False) else OneRow(drafter)


@dataclass
class OwnTree:
    base: dict  # {"kind": "static", "name": ..., "paths": [...]} in the drafter's order of preference
    apply: "Callable[[dict, dict], dict]"  # (constructor spec, a cut of `base`) -> the spec that drafts that cut


def chain_paths(n: int) -> list[list[int]]:
    """A chain of n tokens as static-tree paths: [[0], [0, 0], ...]."""
    return [[0] * i for i in range(1, n + 1)]


class NoDrafter(Drafter):
    """The autoregressive baseline: the same engine with an empty tree, so every step is one target forward."""

    name = "none"

    def __init__(self, target: object = None):
        del target  # needs nothing from the target

    def prefill(self, state: TargetState) -> None:
        pass

    def propose(self, state: TargetState) -> DraftTree:
        return DraftTree.empty(state.tokens.shape[0], state.tokens.device)

    def on_verified(self, state: TargetState) -> None:
        pass

    batched = True
    prefill_rows, propose_rows, on_verified_rows = prefill, propose, on_verified

    def keep_rows(self, leave: "Leave") -> None:
        pass


@dataclass
class NoOptions:
    """A method with nothing to set."""


@dataclass(frozen=True)
class Restart:
    """A training stage that starts at `at` (a fraction of the budget's steps) with a fresh optimiser and the budget's
    warm-up and decay over its own steps, to a peak of train.lr x `lr_scale` (HASS's train.sh: a second run from the
    first's weights at 1e-5 where the first ran at 3e-5)."""

    at: float
    lr_scale: float = 1.0


class TrainableDrafter(Drafter):
    """A drafter with trained weights. Each method supplies only its module, its loss and its own-prediction chain;
    the shared trainer (specbench/train/trainer.py) does data, features, optimisation, validation, checkpoints and DDP.

    `Options` is the method's typed options (a dataclass): what its YAML's `module:` may set, the module's shape and
    the method's training hyperparameters alike. Checkpoints record them as a dict; `options()` types them, and an
    unknown name is one clear error. The trainer builds the module from them and passes them, with the plain module
    (never a DDP wrapper: the trainer averages gradients across ranks itself), to `training_steps` / `training_loss`.

    Training batches (specbench.train.Batch) carry, right-padded to the longest sequence:
      input_ids [B, T], loss_mask [B, T] (1 on assistant tokens), attn_mask [B, T] (1 on real tokens),
      hidden [B, T, H] (the frozen target's last hidden states, clean: targets), hidden_in [B, T, H] (the same with the
      configured noise: inputs).
    """

    Options: ClassVar[type] = NoOptions

    @classmethod
    def options(cls, raw: Mapping | None = None, **overrides):
        """`Options` from a config or checkpoint dict (and keyword overrides); an unknown name fails in one line."""
        from specbench.errors import SpecbenchError

        given = {**(raw or {}), **overrides}
        known = {f.name for f in fields(cls.Options)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise SpecbenchError(f"drafter {cls.name!r} has no option {', '.join(unknown)} "
                                 f"(its module options: {', '.join(sorted(known)) or 'none'})")
        return cls.Options(**given)

    @classmethod
    def load_module(cls, target, checkpoint: str | None, options: dict | None) -> "torch.nn.Module":
        """The decoding-time module: built from the checkpoint's recorded options and loaded with its weights
        (refused for another target), or, without a checkpoint, freshly built from `options` (untrained); in the
        target's dtype, as every method's authors cast their drafter to the base model's (EAGLE's and HASS's
        `ea_layer.to(base_model.dtype)`, Medusa's `medusa_head.to(base_model.dtype)`): a bf16 target drafts in bf16.
        Training keeps fp32 masters: it builds its module with `build_module`, not here."""
        from pathlib import Path

        from specbench.decode.checkpoints import load_checkpoint, read_meta, resolve
        from specbench.errors import SpecbenchError

        options = dict(options or {})
        if checkpoint and (published := cls.load_published(target, resolve(checkpoint), options)) is not None:
            return published.eval().requires_grad_(False)
        if checkpoint:
            meta = read_meta(Path(checkpoint))
            if "drafter" not in meta:  # another project's layout this method does not read (e.g. MoA's published one)
                raise SpecbenchError(f"checkpoint {checkpoint} is not a specbench checkpoint (its config.json names no "
                                     f"drafter) and {cls.name!r} reads no other layout")
            if meta.get("drafter") != cls.name:  # before its options build a module they do not fit
                raise SpecbenchError(f"checkpoint {checkpoint} is a {meta.get('drafter')!r} drafter, not {cls.name!r}")
            options = meta.get("module", options)
        module = cls.build_module(target, cls.options(cls.decoding_options(options)))
        if checkpoint:
            load_checkpoint(Path(checkpoint), module, target, cls.name)
        return module.to(target.dtype).eval().requires_grad_(False)

    @classmethod
    def load_published(cls, target, path: Path, options: dict) -> torch.nn.Module | None:
        """The module of a checkpoint in its method's authors' published layout (read from its own files), or None
        where `path` is not one (the project's checkpoints: load_module reads those)."""
        return None

    @classmethod
    def decoding_options(cls, options: dict) -> dict:
        """The recorded module options a checkpoint is rebuilt with for decoding (training-only ones dropped)."""
        return options

    @classmethod
    @abstractmethod
    def build_module(cls, target, opts) -> "torch.nn.Module":
        """Fresh trainable weights for `target` shaped by `opts` (an `Options`); frozen target weights may be copied
        or referenced, never trained."""

    @classmethod
    @abstractmethod
    def training_loss(cls, module, batch, target, opts) -> tuple["torch.Tensor", dict[str, float]]:
        """Scalar loss and named parts (for the logs)."""

    @classmethod
    def training_steps(cls, module, batch, target, opts, epoch: int,
                       progress: float = 0.0) -> Iterator[tuple["torch.Tensor", dict[str, float]]]:
        """The losses of one batch as independent graphs, backpropagated one after another (gradients accumulate):
        by default the single `training_loss`. `epoch` and `progress` (the fraction of the budget's steps done, in
        [0, 1)) let staged methods switch objectives (Beagle's late stage, HASS's Top-K stage, MoA's curriculum)."""
        del epoch, progress
        yield cls.training_loss(module, batch, target, opts)

    @classmethod
    def fit_options(cls, opts, counts: "torch.Tensor") -> dict:
        """Module options a method sizes from the training data before its module is built: counts [V] as for
        `fit_data`. Returns the options to set (recorded in the checkpoint, so decoding rebuilds the same shapes);
        EAGLE-3 sizes its draft vocabulary by a coverage rule; nothing by default."""
        del opts, counts
        return {}

    @classmethod
    def fit_data(cls, module, counts: "torch.Tensor", opts) -> None:
        """Module state a method derives from the training data before its first step (not on resume: the checkpoint
        carries it): counts [V] = how often each token occurs in the training answers (the loss positions). EAGLE-3
        builds its draft vocabulary from them; nothing by default."""
        del module, counts, opts

    @classmethod
    def feature_layers(cls, module) -> tuple[int, ...]:
        """The target layers (hidden_states indices) whose inputs the method trains on, for a drafter needing LAYERS:
        the trainer computes them per batch from the frozen target into `batch.layers`. None by default."""
        del module
        return ()

    @classmethod
    def restarts(cls, opts) -> tuple["Restart", ...]:
        """Stages that start training afresh part-way through the budget: a new optimiser and a new lr schedule
        (HASS's second stage); none by default."""
        del opts
        return ()

    @classmethod
    def validation_extras(cls, module, val, target) -> dict:
        """Method-specific numbers measured after each epoch on the held-out items `val` (FeatureSet.load dicts),
        logged with the epoch's row and kept in the checkpoint's metrics (Medusa: its heads' top-k accuracies)."""
        del module, val, target
        return {}

    @classmethod
    @abstractmethod
    def chain_predict(cls, module, input_ids, hidden, positions, depth: int, target) -> "torch.Tensor":
        """Greedy chain drafting on the drafter's own predictions, for validation: for each root position t in
        `positions` (the root is input_ids[t]; target hidden states are known for tokens < t), the `depth` tokens the
        drafter proposes for t+1 .. t+depth. input_ids [T], hidden [T, H] -> [P, depth]."""
