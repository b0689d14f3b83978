"""The generation loop shared by every method (the baseline is this loop with NoDrafter), one loop for every batch
size: `generate` is `generate_batch` of one prompt.

1. prefill the prompts on the target, take each row's first token (the root), hand the drafter what it needs;
2. the drafter proposes one DraftTree for all live rows ([A, N], padded to one node count);
3. one target forward over every row's [root, nodes] with its tree mask and depth positions;
4. acceptance (verify.py, on the device, all rows at once): greedy or recursive rejection sampling -> each row's
   accepted path + bonus/recovered token;
5. each row's emitted tokens, where it stops (EOS, its max_new_tokens) and its counters' numbers are decided on the
   device (outcome.py); one host transfer reads them (not the trees) with whatever the drafter staged for its next
   tree (Lookahead); compact the target cache to the accepted paths, tell the drafter through the next TargetState; a
   finished row leaves the batch (specbench/decode/rows.py).
Every batch size, 1 included, takes this one path (issue 77): ragged rows in a preallocated cache (model.compile: the
static cache of its batch bucket) under explicit per-row masks and positions; a lone row's chain skips its mask (the
model's causal one says the same: an optimisation, not another path).
Host round trips per step: that one transfer, and none of the drafters' (a traced run reads the trees besides;
tests/test_roundtrips.py counts them).
Steps 1 and 3-5's target work (prefill, forward, acceptance, outcome, the read, compaction, the drafter's rows) sit
behind a verifier (specbench/decode/verifier.py): LocalVerifier in this process, or a split's RemoteVerifier
(specbench/deploy/client.py) whose target is a server; the engine keeps the drafter, the rows, counters and clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from typing import Callable

from specbench.decode.clock import StepClock, sync
from specbench.decode.drafter import LAYERS, Drafter, check_batched, rows_protocol
from specbench.decode.outcome import RowStep
from specbench.decode.rows import Row, RowCounts, Rows
from specbench.decode.target import TargetModel
from specbench.decode.types import DraftTree, Lookahead, SamplingParams, TargetState
from specbench.decode.verifier import LocalVerifier, Prefilled, layer_ids


@dataclass
class StepTrace:
    """One verification step as the tree cost model reads it (Engine(trace=True); specbench/bench/costmodel.py)."""

    parents: list[int]  # the drafted tree, -1 = the root
    priority: list[float] | None  # the policy's preference per node (DraftTree.priority), None = node order
    path: list[int]  # the accepted nodes, root's child first
    tokens: list[int] | None = None  # the drafted tokens (tests compare a batched row's drafts with its lone ones)


TREE_ROOM = 256  # cache positions past prompt + budget: one drafted tree before its compaction


@dataclass
class Generation:
    """One prompt turn: the new tokens and the counters every method is measured by."""

    new_tokens: list[int]
    prompt_tokens: int
    wall_s: float
    prefill_s: float
    draft_s: float = 0.0
    verify_s: float = 0.0  # target tree forward + acceptance + cache compaction
    steps: int = 0  # target verification forwards (prefill not counted)
    tokens_per_step: list[int] = field(default_factory=list)  # emitted per step: accepted + 1 (cut at EOS/max)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes per step
    depth_trials: list[int] = field(default_factory=list)  # [d-1]: steps whose draft offered a node at depth d
    #                                                         below an accepted path of length d-1
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps that accepted a node at depth d
    recovered: int = 0  # steps that ended with a recovered (not bonus) token
    stopped_by: str = "max_new_tokens"  # or "eos", or "context" (set by the caller whose budget the context cut)
    chain: bool = True  # every drafted tree was a chain (Leviathan's formula applies)
    trace: list[StepTrace] = field(default_factory=list)  # per step, only with Engine(trace=True)
    # generate(capture_at=k): the logits row that chose new token k [V] (the prefill's last row, or the tree row of
    # the node below which it was accepted or drawn); None otherwise (specbench/bench/divergence.py replays with it)
    captured: torch.Tensor | None = None
    # a split (specbench/deploy): the new tokens the client drafted alone after its link dropped (counted in
    # new_tokens), and the run's split measurements (calls, bytes, the step's time split; deploy/client.py)
    alone_tokens: int = 0
    split: dict | None = None

    @property
    def tau(self) -> float:
        """Mean acceptance length: new tokens per verification step, the bonus/recovered token included."""
        return sum(self.tokens_per_step) / self.steps if self.steps else float("nan")


def _count_depths(gen: Generation, step: RowStep) -> None:
    """Per-depth acceptance (EAGLE's n-alpha for chains): depth d is tried when the path reached d-1 and the
    last accepted node (or the root) has a drafted child (then one was rejected: `recovered`); accepted when the path
    reaches d. The lists reach the tree's deepest node."""
    tried = step.accepted + int(step.recovered)
    need = max(tried, step.deepest)
    for lst in (gen.depth_trials, gen.depth_accepts):
        lst.extend([0] * (need - len(lst)))
    for d in range(tried):
        gen.depth_trials[d] += 1
    for d in range(step.accepted):
        gen.depth_accepts[d] += 1


@dataclass
class BatchGeneration:
    """One batch of prompts decoded together (Engine.generate_batch): per-row Generations (each row's wall_s is the
    time from the batch's start to that row's last token, its prefill_s the batch's prefill, its verify_s the batched
    forwards it took part in) and the batch's own clock."""

    rows: list[Generation]
    wall_s: float  # prefill to the last row's end
    prefill_s: float
    steps: int = 0  # batched target forwards after the prefill
    active: list[int] = field(default_factory=list)  # rows verified per step (finished rows leave the batch)

    @property
    def draft_s(self) -> float:
        """The batch's draft seconds: every step's are credited to each live row, and the row that finished last took
        part in every step."""
        return max(g.draft_s for g in self.rows)

    @property
    def verify_s(self) -> float:
        """The batch's verify seconds (as draft_s)."""
        return max(g.verify_s for g in self.rows)

    @property
    def tokens_per_s(self) -> float:
        """Throughput: new tokens summed over the rows, per second of the batch's wall time."""
        return sum(len(g.new_tokens) for g in self.rows) / self.wall_s if self.wall_s > 0 else float("nan")


class Engine:
    def __init__(self, target: TargetModel, drafter: Drafter, sampling: SamplingParams, trace: bool = False,
                 verifier: "Callable[[Drafter], LocalVerifier] | None" = None):
        """trace=True keeps every step's tree, drafted tokens and accepted path (host reads of each row's tokens and
        priorities per step: calibration and tests only). verifier: the target's half of each generation, built for
        its drafter (default: LocalVerifier, the target in this process; specbench/deploy's RemoteVerifier: across a
        connection)."""
        self.target, self.drafter, self.sampling, self.trace = target, drafter, sampling, trace
        self.verifier_for = verifier or (lambda d: LocalVerifier(target, sampling, d.needs, layer_ids(d)))

    def _state(self, rows: Rows, hidden: torch.Tensor | None, fresh: RowCounts, verifier,
               layers: torch.Tensor | None, capacity: int, lookahead: Lookahead | None) -> TargetState:
        """What the drafter reads of every live row (target_state), the EAGLE-3 layers only to a drafter that reads
        them."""
        return target_state(rows, hidden, fresh, verifier, layers=layers if LAYERS in self.drafter.needs else None,
                            sampling=self.sampling, capacity=capacity, lookahead=lookahead)

    @staticmethod
    def _count_step(gen: Generation, step: RowStep, size: int) -> None:
        """One verification step's tokens and counters for one row (size: its verified tree's nodes)."""
        gen.new_tokens.extend(step.emitted)
        gen.steps += 1
        gen.tokens_per_step.append(len(step.emitted))
        gen.tree_sizes.append(size)
        gen.recovered += int(step.recovered)
        gen.chain &= step.chain
        if step.stop is not None:
            gen.stopped_by = step.stop
        _count_depths(gen, step)

    @staticmethod
    def _trace_step(gens: list[Generation], tree: DraftTree, path: torch.Tensor, steps: list[RowStep]) -> None:
        """Engine(trace=True): every row's tree, drafted tokens and accepted path (a second host read)."""
        a, n = tree.tokens.shape
        parts = [tree.tokens.flatten(), tree.parents.flatten(), path.flatten()]
        flat = torch.cat(parts).tolist()
        prio = tree.priority.flatten().tolist() if tree.priority is not None else None
        for r, (gen, k) in enumerate(zip(gens, tree.row_sizes())):
            at = r * n
            gen.trace.append(StepTrace(flat[a * n + at : a * n + at + k], None if prio is None else prio[at : at + k],
                                       flat[2 * a * n + at : 2 * a * n + at + steps[r].accepted], flat[at : at + k]))

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None = None,
                 context: int | None = None, capture_at: int | None = None) -> Generation:
        """One prompt: generate_batch of one. context: the target's positions; a drafted tree that would reach past
        them is not verified (the step decodes one token, as the baseline does: lossless, and the drafter rolls its
        tree back as if every node were rejected). With max_new_tokens <= context - prompt, every method then stops at
        the same token."""
        out = self.generate_batch([prompt_ids], max_new_tokens, [generator], context,
                                  None if capture_at is None else {0: capture_at})
        return out.rows[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                       generators: list[torch.Generator | None] | None = None,
                       context: int | None = None, capture_at: dict[int, int] | None = None) -> BatchGeneration:
        """B prompts decoded together: one prefill, then per step the drafter proposes every live row's tree (one
        padded DraftTree), one target forward verifies all rows (per-row tree masks and positions over a ragged
        preallocated cache), acceptance runs for all rows on the device and one host read serves the whole
        batch. A finished row leaves the batch (the last live row takes its cache row): the batch shrinks rather than
        refills, so every row of a batch of B is decoded beside the same prompts at every B-sweep point (continuous
        batching would mix in prompts from later batches). At T=0 each row's output is its prompt's greedy output (at
        this batch's numerics: a batched matmul may round differently from a lone one); at T>0 each row samples with
        its own generator. `context` as in generate(). capture_at {row: k}: the logits row that chose row's new token k
        (the divergence replay, specbench/bench/divergence.py)."""
        devs, eos = self.target.devices, self.target.eos_token_ids
        b = len(prompts)
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, list) else [max_new_tokens] * b
        generators = list(generators) if generators is not None else [None] * b
        if not (len(budgets) == len(generators) == b) or b == 0:
            raise ValueError(f"{b} prompts, {len(budgets)} budgets and {len(generators)} generators")
        check_batched(self.drafter, b)
        capture_at = capture_at or {}
        lens = [len(p) for p in prompts]
        verifier = self.verifier_for(self.drafter)  # the target's half of every step (verifier.py)
        sync(devs)
        t0 = time.perf_counter()
        opened = open_rows(verifier, prompts, budgets, generators, context)
        pre, ids, prefix, limits, need = opened.pre, opened.ids, opened.prefix, opened.limits, opened.need
        first, logits = pre.first, pre.logits
        drafter = rows_protocol(self.drafter, b)
        # what the drafter stages for its first tree joins the prefill's read of the first tokens
        look = drafter.lookahead_rows(ids[:, : max(lens) + 1], prefix.dev + 1)
        head = torch.cat([first, look.counts]).tolist() if look is not None else first.tolist()
        first_host, look = head[:b], None if look is None else look.read(head[b:])
        rows = Rows([Row(i, Generation(new_tokens=[first_host[i]], prompt_tokens=lens[i], wall_s=0.0, prefill_s=0.0),
                         budgets[i], generators[i], capture_at.get(i)) for i in range(b)], ids, prefix)
        gens = [row.gen for row in rows.live]
        for row in rows.live:
            if row.capture_at == 0:
                row.gen.captured = logits[row.index].clone()
        done = set()
        for r, row in enumerate(rows.live):
            if first_host[r] in eos:
                row.gen.stopped_by = "eos"
            if first_host[r] in eos or row.budget <= 1:
                done.add(r)  # done at the prefill: leaves before the drafter sees it
        hid, lay, fresh = pre.hidden, pre.layers, prefix  # (the prompt's hidden rows)
        if done:
            step = self._leave(rows, done, verifier, None)
            hid, lay = _keep(hid, step), _keep(lay, step)
            fresh, limits, look = rows.prefix, limits.keep(step), None if look is None else look.keep(step)
        if len(rows):
            # a drafter's own caches: the need, unclamped (a tree past the context is drafted before it is dropped)
            state = self._state(rows, hid, fresh, verifier, lay, need, look)
            drafter.prefill_rows(state)
        sync(devs)
        batch = BatchGeneration(rows=gens, wall_s=0.0, prefill_s=time.perf_counter() - t0)
        for g in gens:
            g.prefill_s = batch.prefill_s
            if g not in (row.gen for row in rows.live):
                g.wall_s = batch.prefill_s
        # the phases' times, marked without a drain (the step's host read below is its one wait), read at the end
        clock = StepClock(devs, offset=batch.prefill_s)
        while len(rows):
            if not verifier.online:  # a split whose link dropped (specbench/deploy): the drafter finishes alone
                self._alone(rows, state, clock)
                break
            td = clock.mark()
            tree = drafter.propose_rows(state)
            tv = clock.mark()
            tree = self._within_context(tree, rows, context)
            sizes = tree.row_sizes()
            # the target's forward, acceptance and outcome; the new tokens written into rows.ids (on the device)
            step_v = verifier.verify(tree, rows, limits)
            acc, a, n = step_v.acc, *tree.tokens.shape
            # the drafter stages its next tree's host ints from them (lengths: prefix + root + accepted + next) ...
            look = drafter.lookahead_rows(rows.ids[:, : rows.prefix.max() + n + 2], rows.prefix.dev + acc.length + 2)
            # ... and the step's one host transfer carries them with every row's outcome (then the cache compaction)
            fin = verifier.finish(step_v, rows, None if look is None else look.counts)
            read = fin.read
            look = None if look is None else look.read(read.staged)
            if self.trace:
                self._trace_step([row.gen for row in rows.live], tree, acc.path, read.rows)
            clock.step(td, tv, clock.mark(), [row.gen for row in rows.live])
            batch.steps += 1
            batch.active.append(a)
            fresh = fin.accepted + 1  # each row's root + accepted path
            rows.prefix = rows.prefix + fresh
            done = set()
            for r, (row, st) in enumerate(zip(rows.live, read.rows)):
                gen = row.gen
                before = len(gen.new_tokens)
                if row.capture_at is not None and before <= row.capture_at < before + len(st.emitted):
                    # emitted token t was chosen at the row of its parent: the root (row 0), then accepted node path[t-1]
                    t = row.capture_at - before
                    at = torch.cat([acc.path.new_zeros(1), acc.path[r] + 1])[t : t + 1]  # (on the device)
                    gen.captured = step_v.logits[r].index_select(0, at)[0].clone()
                self._count_step(gen, st, sizes[r])
                if st.stop is not None:
                    clock.finish(gen, clock.mark())
                    done.add(r)
            hid, lay = fin.hidden, fin.layers  # the rows of every root and accepted path
            if done:
                if len(done) == a:
                    break
                step = self._leave(rows, done, verifier, drafter)
                hid, lay = _keep(hid, step), _keep(lay, step)
                fresh, limits = fresh.keep(step), limits.keep(step)
                look = None if look is None else look.keep(step)
            state = self._state(rows, hid, fresh, verifier, lay, need, look)
            drafter.on_verified_rows(state)
        clock.resolve()  # (its one wait for the device, where it marked with events)
        sync(devs)
        batch.wall_s = time.perf_counter() - t0
        verifier.end(gens)  # (a split: the server's own times of this answer, read after the clock stopped)
        return batch

    def _alone(self, rows: Rows, state: TargetState, clock: StepClock) -> None:
        """The target is gone (a split's disconnection, MoA's Table 4): the lone row's remaining tokens from the
        drafter's own greedy continuation (Drafter.continue_alone), cut after an EOS."""
        row = rows.live[0]
        gen, eos = row.gen, self.target.eos_token_ids
        tokens = self.drafter.continue_alone(state, row.budget - len(gen.new_tokens))[0].tolist()
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        gen.new_tokens.extend(tokens[:cut])
        gen.alone_tokens = cut
        gen.stopped_by = "eos" if tokens[:cut] and tokens[cut - 1] in eos else "max_new_tokens"
        clock.finish(gen, clock.mark())

    def _within_context(self, tree: DraftTree, rows: Rows, context: int | None) -> DraftTree:
        """A row whose tree would reach past the context's last position verifies no node (as the baseline decodes
        there); the node count bounds the depth, so no host read is needed."""
        if context is None:
            return tree
        sizes = tree.row_sizes()
        over = [r for r, (p, k) in enumerate(zip(rows.prefix, sizes)) if p + 1 + k > context]
        if not over:
            return tree
        keep = [0 if r in over else k for r, k in enumerate(sizes)]
        n = max(keep)
        valid = (tree.valid if tree.valid is not None else torch.ones_like(tree.tokens, dtype=torch.bool))
        valid = valid & torch.tensor([r not in over for r in range(len(sizes))], device=valid.device)[:, None]
        return DraftTree(tokens=tree.tokens[:, :n], parents=tree.parents[:, :n],
                         draft_probs=None if tree.draft_probs is None else tree.draft_probs[:, :n],
                         is_chain=n == 0, priority=None if tree.priority is None else tree.priority[:, :n],
                         sizes=keep, valid=valid[:, :n])

    def _leave(self, rows: Rows, done: set[int], verifier, drafter):
        """Finished rows leave the batch: the rows, the target's cache and the drafter (None: not started yet) reorder
        alike."""
        step = rows.leave(done)
        verifier.leave(step, rows)
        if drafter is not None:
            drafter.keep_rows(step)
        return step


def _keep(x: torch.Tensor | None, step) -> torch.Tensor | None:
    """The rows of x [A, ...] a leave keeps, in their new order."""
    return None if x is None else x.index_select(0, step.index_t)


@dataclass
class Opened:
    """The rows after the target's prefill, as every decode loop starts them (Engine.generate_batch; a split's server,
    specbench/deploy/server.py, opens its one row the same way)."""

    pre: Prefilled
    ids: torch.Tensor  # [B, need + 1] every row's verified tokens: its prompt, then its first new token (the root)
    prefix: RowCounts  # [B] each row's cached entries: its prompt
    limits: RowCounts  # [B] the verified tokens at which each row has spent its budget (prompt + max_new_tokens)
    need: int  # the positions a generation can reach: prompt, new tokens, and one tree past them before compaction


def open_rows(verifier, prompts: list[list[int]], budgets: list[int], generators: list[torch.Generator | None],
              context: int | None) -> Opened:
    """Prefill the prompts through the verifier and lay out each row's verified tokens, prefix and limit."""
    lens = [len(p) for p in prompts]
    need = max(lens) + max(budgets) + TREE_ROOM
    # bounded by the context plus room for one padded tree: every row writes the step's widest tree (padding
    # included), so a row near the context still writes up to max tree nodes past it
    pre = verifier.prefill(prompts, budgets, min(need, context + TREE_ROOM) if context else need, generators)
    dev = pre.first.device
    prefix = RowCounts.copy(lens, dev)
    limits = prefix + budgets[0] if len(set(budgets)) == 1 else RowCounts.copy(
        [n + m for n, m in zip(lens, budgets)], dev)
    ids = torch.zeros(len(prompts), need + 1, dtype=torch.long, device=dev)
    ids[:, : pre.ids.shape[1]] = pre.ids
    ids.scatter_(1, prefix.dev[:, None], pre.first[:, None])  # the root behind each prompt
    return Opened(pre, ids, prefix, limits, need)


def target_state(rows: Rows, hidden: torch.Tensor | None, fresh: RowCounts, verifier, *,
                 layers: torch.Tensor | None = None, sampling: SamplingParams | None = None, capacity: int = 0,
                 lookahead: Lookahead | None = None) -> TargetState:
    """What a drafter reads of every live row: tokens, the hidden rows just written (row r's first fresh[r]; the
    verifier gives them only to a drafter that reads them), the target's K/V, the EAGLE-3 layers."""
    lengths = rows.prefix + 1
    gens = tuple(r.generator for r in rows.live)
    kv, kv_static = verifier.kv()
    return TargetState(tokens=rows.ids[:, : lengths.max()], hidden=hidden, kv=kv, kv_static=kv_static, layers=layers,
                       sampling=sampling or SamplingParams(), generator=gens[0] if len(gens) == 1 else None,
                       capacity=capacity, lengths=lengths, fresh=fresh, generators=gens, lookahead=lookahead)
