"""The generation loop shared by every method (the baseline is this loop with NoDrafter).

1. prefill the prompt on the target, take the first token (the root), hand the drafter what it needs;
2. drafter proposes a DraftTree;
3. one target forward over [root, nodes] with the tree mask and depth positions;
4. acceptance (verify.py, on the device): greedy or recursive rejection sampling -> accepted path + bonus/recovered;
5. one host transfer reads the tree and its outcome; compact the target cache to the accepted path, tell the drafter;
   stop at EOS or max_new_tokens.
Host round trips per step: the drafter's own (none per node for the tree drafters) plus that one transfer
(tests/test_roundtrips.py bounds both).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specbench.decode.drafter import HIDDEN, KV, LAYERS, Drafter
from specbench.errors import SpecbenchError
from specbench.decode.sampling import logits_to_probs, sample
from specbench.decode.kvcache import PreallocatedCache
from specbench.decode.target import TargetModel, cache_kv, compact_cache, compact_rows, row_kv
from specbench.decode.tree import ancestor_matrix, batch_tree_mask, is_chain, node_depths, padded_ancestors, tree_position_ids
from specbench.decode.types import DraftTree, SamplingParams, TargetState, VerifyResult
from specbench.decode.verify import greedy_accept, rejection_accept


def sync(device: torch.device | tuple[torch.device, ...]) -> None:
    """Wait for queued device work, so that the clock measures it: on every device a target spread over several
    (model.device_map) computes on, not only the engine's."""
    for d in device if isinstance(device, tuple) else (device,):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@dataclass
class StepTrace:
    """One verification step as the tree cost model reads it (Engine(trace=True); specbench/bench/costmodel.py)."""

    parents: list[int]  # the drafted tree, -1 = the root
    priority: list[float] | None  # the policy's preference per node (DraftTree.priority), None = node order
    path: list[int]  # the accepted nodes, root's child first


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

    @property
    def tau(self) -> float:
        """Mean acceptance length: new tokens per verification step, the bonus/recovered token included."""
        return sum(self.tokens_per_step) / self.steps if self.steps else float("nan")


def _count_depths(gen: Generation, parents: list[int], path: list[int]) -> None:
    """Per-depth acceptance (EAGLE's n-alpha for chains): depth d is tried when the path reached d-1 and the
    last accepted node (or the root) has a drafted child; accepted when the path reaches d."""
    depths = node_depths(parents)
    last = path[-1] if path else -1
    tried = len(path) + (1 if any(p == last for p in parents) else 0)
    need = max(tried, max(depths, default=0))
    for lst in (gen.depth_trials, gen.depth_accepts):
        lst.extend([0] * (need - len(lst)))
    for d in range(tried):
        gen.depth_trials[d] += 1
    for d in range(len(path)):
        gen.depth_accepts[d] += 1


def _emit(gen: Generation, tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """The accepted tokens and the bonus/recovered one, cut at EOS or the token budget -> (emitted, done)."""
    emitted: list[int] = []
    for tok in tokens:
        emitted.append(tok)
        if tok in eos:
            gen.stopped_by = "eos"
            return emitted, True
        if len(gen.new_tokens) + len(emitted) >= max_new_tokens:
            return emitted, True
    return emitted, False


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
    def tokens_per_s(self) -> float:
        """Throughput: new tokens summed over the rows, per second of the batch's wall time."""
        return sum(len(g.new_tokens) for g in self.rows) / self.wall_s if self.wall_s > 0 else float("nan")


class Engine:
    def __init__(self, target: TargetModel, drafter: Drafter, sampling: SamplingParams, trace: bool = False):
        """trace=True keeps every step's tree and accepted path (one more host read per step: calibration only)."""
        self.target, self.drafter, self.sampling, self.trace = target, drafter, sampling, trace

    def _state(self, tokens: torch.Tensor, hidden: torch.Tensor | None, cache, generator,
               layers: torch.Tensor | None = None, capacity: int = 0) -> TargetState:
        needs = self.drafter.needs
        return TargetState(
            tokens=tokens,
            hidden=hidden if HIDDEN in needs else None,
            kv=cache_kv(cache, self.target.device) if KV in needs else None,
            layers=layers if LAYERS in needs else None,
            sampling=self.sampling,
            generator=generator,
            capacity=capacity,
        )

    def _first_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.sampling.greedy:
            return int(logits.argmax(-1).item())
        return int(sample(logits_to_probs(logits, self.sampling), generator).item())

    def _count_step(self, gen: Generation, tree: DraftTree, emitted: list[int], parents: list[int], path: list[int],
                    recovered: bool) -> None:
        """One verification step's counters (the tokens themselves are appended by the caller)."""
        gen.new_tokens.extend(emitted)
        gen.steps += 1
        gen.tokens_per_step.append(len(emitted))
        gen.tree_sizes.append(len(parents))
        gen.recovered += int(recovered)
        gen.chain &= is_chain(parents)
        if self.trace:
            priority = tree.priority[0].tolist() if tree.priority is not None else None
            gen.trace.append(StepTrace(parents, priority, path))
        _count_depths(gen, parents, path)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None = None,
                 context: int | None = None, capture_at: int | None = None) -> Generation:
        """context: the target's positions; a drafted tree that would reach past them is not verified (the step
        decodes one token, as the baseline does: lossless, and the drafter rolls its tree back as if every node were
        rejected). With max_new_tokens <= context - prompt, every method then stops at the same token."""
        target, drafter, dev = self.target, self.drafter, self.target.device
        devs = target.devices  # every device the target computes on
        eos = target.eos_token_ids
        prompt = torch.tensor([prompt_ids], device=dev)  # [1, L]
        sync(devs)
        t0 = time.perf_counter()
        # the positions this generation can reach: prompt, new tokens, and one tree past them before compaction
        need = len(prompt_ids) + max_new_tokens + TREE_ROOM
        cache = target.new_cache(min(need, context) if context else need)  # the context bounds it; it is not the need
        layers = tuple(drafter.hidden_layers) if LAYERS in drafter.needs else ()  # EAGLE-3's low/middle/high
        fwd = target.prefill(prompt, cache, layers=layers)
        first = self._first_token(fwd.logits[0, -1], generator)
        tokens = torch.cat([prompt, torch.tensor([[first]], device=dev)], dim=1)
        out = [first]
        # a drafter's own cache: the need, unclamped (a tree past the context is drafted before the engine drops it)
        state = self._state(tokens, fwd.hidden, cache, generator, fwd.layers, need)
        drafter.prefill(state)
        sync(devs)
        gen = Generation(new_tokens=out, prompt_tokens=len(prompt_ids), wall_s=0.0, prefill_s=time.perf_counter() - t0)
        if capture_at == 0:
            gen.captured = fwd.logits[0, -1].clone()
        done = first in eos or max_new_tokens <= 1
        if first in eos:
            gen.stopped_by = "eos"
        while not done:
            td = time.perf_counter()
            tree = drafter.propose(state)
            sync(devs)
            tv = time.perf_counter()
            gen.draft_s += tv - td
            prefix = cache.get_seq_length()
            proposed = tree.num_nodes
            if context is not None and prefix + 1 + proposed > context:  # root + nodes past the last position
                tree = DraftTree.empty(device=dev)  # (the node count bounds the depth: no host read needed)
            n = tree.num_nodes
            node_tok, node_par = tree.tokens[0], tree.parents[0]  # [N], [N] on the device
            anc = ancestor_matrix(node_par)  # [N+1, N+1]
            fwd = target.verify(tokens[:, -1:], tree.tokens, anc, cache, causal=tree.is_chain, layers=layers)
            logits = fwd.logits[0]  # [N+1, V]
            if self.sampling.greedy:
                acc = greedy_accept(node_tok, node_par, anc, logits.argmax(-1))
            else:
                q = tree.draft_probs[0] if tree.draft_probs is not None else None
                acc = rejection_accept(node_tok, node_par, anc, logits_to_probs(logits, self.sampling), q, generator)
            # the step's one host transfer: the tree and its outcome, for the bookkeeping below
            host = torch.cat([node_tok, node_par, acc.path,
                              torch.stack([acc.length, acc.next_token, acc.recovered.long()])]).tolist()
            node_tokens, parents = host[:n], host[n : 2 * n]
            length, next_token, recovered = host[3 * n :]
            path = host[2 * n : 2 * n + length]
            keep = acc.path[:length]  # [A] on the device
            compact_cache(cache, prefix, keep, contiguous=path == list(range(length)))
            sync(devs)
            gen.verify_s += time.perf_counter() - tv
            emitted, done = _emit(gen, [node_tokens[i] for i in path] + [next_token], eos, max_new_tokens)
            if capture_at is not None and len(out) <= capture_at < len(out) + len(emitted):
                # emitted token t was chosen at the row of its parent: the root (row 0), then accepted node path[t-1]
                choosers = [0] + [i + 1 for i in path]
                gen.captured = logits[choosers[capture_at - len(out)]].clone()
            self._count_step(gen, tree, emitted, parents, path, bool(recovered))
            if done:
                break
            rows = torch.cat([keep.new_zeros(1), keep + 1])  # root + accepted nodes are now in the target cache
            new = torch.cat([node_tok[keep], acc.next_token[None]])  # [A+1] == emitted (not cut: not done)
            tokens = torch.cat([tokens, new[None]], dim=1)
            state = self._state(tokens, fwd.hidden[:, rows], cache, generator,
                                None if fwd.layers is None else fwd.layers[:, rows], need)
            result = VerifyResult(
                accepted_nodes=path,
                accepted_tokens=[node_tokens[i] for i in path],
                next_token=next_token,
                recovered=bool(recovered),
                num_nodes=proposed,  # a dropped tree: every proposed node rejected, from the drafter's side
                emitted=emitted,
                hidden=state.hidden,
            )
            drafter.on_verified(result, state)
        sync(devs)
        gen.wall_s = time.perf_counter() - t0
        return gen

    # ---- batched decoding (issue 29) ----------------------------------------------------------------------------
    def _row_state(self, tokens: torch.Tensor, hidden: torch.Tensor | None, cache, row: int, length: int, generator,
                   layers: torch.Tensor | None, capacity: int) -> TargetState:
        """What the drafter of one batch row reads: its tokens [1, T], its rows of the step's hidden states and its
        `length` entries of the ragged target cache (of `capacity` positions a row)."""
        needs = self.drafter.needs
        return TargetState(tokens=tokens, hidden=hidden if HIDDEN in needs else None,
                           kv=row_kv(cache, row, length, self.target.device) if KV in needs else None,
                           layers=layers if LAYERS in needs else None, sampling=self.sampling, generator=generator,
                           capacity=capacity)

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                       generators: list[torch.Generator | None] | None = None,
                       context: int | None = None, capture_at: dict[int, int] | None = None) -> BatchGeneration:
        """B prompts decoded together: one prefill, then per step each row's drafter (its own instance,
        Drafter.fork) proposes its tree, the trees are padded to one node count and verified in one target forward
        (per-row tree masks and positions over a ragged preallocated cache), acceptance runs per row on the device
        and one host read serves the whole batch. A finished row leaves the batch (its cache row is dropped): the
        batch shrinks rather than refills, so every row of a batch of B is decoded beside the same prompts at every
        B-sweep point (continuous batching would mix in prompts from later batches). At T=0 each row's output is
        its prompt's greedy output (at this batch's numerics: a batched matmul may round differently from a lone
        one); at T>0 each row samples with its own generator. `context` as in generate(). capture_at {row: k}: as
        generate()'s, per row (the divergence replay of a batched turn, specbench/bench/divergence.py)."""
        target, dev, devs, eos = self.target, self.target.device, self.target.devices, self.target.eos_token_ids
        if target.compiled is not None:  # (its drafters' forks would share one static cache)
            raise SpecbenchError("model.compile=true decodes one prompt at a time (decoding.batch_size=1)")
        b = len(prompts)
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, list) else [max_new_tokens] * b
        generators = list(generators) if generators is not None else [None] * b
        if not (len(budgets) == len(generators) == b) or b == 0:
            raise ValueError(f"{b} prompts, {len(budgets)} budgets and {len(generators)} generators")
        drafters = [self.drafter] + [self.drafter.fork() for _ in range(b - 1)]
        lens = [len(p) for p in prompts]
        width = max(lens)
        sync(devs)
        t0 = time.perf_counter()
        # ragged rows need buffers written in place: the preallocated cache, whatever model.cache says
        need = width + max(budgets) + TREE_ROOM
        # Bounded by the context, plus room for one padded tree: every row writes the step's widest tree (padding
        # included), so a row whose prefix is near the context still writes up to max tree nodes past it (generate()
        # writes only its own tree, which the context check keeps inside). Without the room, the buffers would be
        # reallocated at twice their size mid-turn, there only.
        cache = PreallocatedCache(target.model.config, min(need, context + TREE_ROOM) if context else need)
        capacity = need  # each row's drafter caches (unclamped, as in generate)
        layers = tuple(self.drafter.hidden_layers) if LAYERS in self.drafter.needs else ()
        # right-padded prompts under the causal mask: a real token never sees the padding after it
        ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=dev)  # [B, L]
        fwd = target.forward(ids, cache, logits_rows=slice(0, 0), layers=layers)
        last = torch.tensor([n - 1 for n in lens], device=dev)
        logits = target.lm_head(fwd.hidden[torch.arange(b, device=dev), last]).float()  # [B, V]
        if self.sampling.greedy:
            first = logits.argmax(-1).tolist()
        else:
            first = [int(sample(logits_to_probs(logits[i], self.sampling), generators[i])) for i in range(b)]
        cache.set_row_lengths(lens)
        gens = [Generation(new_tokens=[first[i]], prompt_tokens=lens[i], wall_s=0.0, prefill_s=0.0) for i in range(b)]
        capture_at = capture_at or {}
        for i, k in capture_at.items():
            if k == 0:
                gens[i].captured = logits[i].clone()
        tokens = [torch.cat([ids[i : i + 1, : lens[i]], torch.tensor([[first[i]]], device=dev)], 1) for i in range(b)]
        states = {}
        for i in range(b):
            states[i] = self._row_state(tokens[i], fwd.hidden[i : i + 1, : lens[i]], cache, i, lens[i], generators[i],
                                        None if fwd.layers is None else fwd.layers[i : i + 1, : lens[i]], capacity)
            drafters[i].prefill(states[i])
        sync(devs)
        batch = BatchGeneration(rows=gens, wall_s=0.0, prefill_s=time.perf_counter() - t0)
        for g in gens:
            g.prefill_s = batch.prefill_s
        for i in range(b):
            if first[i] in eos:
                gens[i].stopped_by = "eos"
        active = [i for i in range(b) if first[i] not in eos and budgets[i] > 1]  # cache row r holds prompt active[r]
        for i in range(b):
            if i not in active:
                gens[i].wall_s = batch.prefill_s
                del states[i]  # done at the prefill: neither its state nor its drafter is kept
                drafters[i] = None
        prefix = [lens[i] for i in active]  # entries each active row holds (its root is not among them)
        lengths = torch.tensor(prefix, device=dev)  # [A] the same on the device: the masks read it, never the host
        if active and len(active) < b:
            cache.keep_rows(torch.tensor(active, device=dev), prefix)
        while active:
            trees, proposed = [], []
            for i in active:
                td = time.perf_counter()
                tree = drafters[i].propose(states[i])
                sync(devs)
                gens[i].draft_s += time.perf_counter() - td
                proposed.append(tree.num_nodes)
                trees.append(tree)
            tv = time.perf_counter()
            for r, i in enumerate(active):
                if context is not None and prefix[r] + 1 + trees[r].num_nodes > context:
                    trees[r] = DraftTree.empty(device=dev)  # as generate(): decoded one token, every node rejected
            sizes = [t.num_nodes for t in trees]
            q = 1 + max(sizes)
            ancs = [ancestor_matrix(t.parents[0]) for t in trees]  # [n+1, n+1] each
            roots = torch.stack([t[0, -1] for t in (tokens[i] for i in active)])  # [A]
            pad = roots.new_zeros(q - 1)
            ids = torch.stack([torch.cat([roots[r : r + 1], t.tokens[0], pad[: q - 1 - t.num_nodes]])
                               for r, t in enumerate(trees)])  # [A, Q]
            pos = torch.cat([torch.cat([tree_position_ids(a, p)[0], a.new_full((q - a.shape[0],), p, dtype=torch.long)])[None]
                             for a, p in zip(ancs, prefix)])  # [A, Q]
            width = max(prefix) + q
            mask = batch_tree_mask(torch.stack([padded_ancestors(a, q) for a in ancs]), lengths, width,
                                   target.dtype)  # [A, 1, Q, W]
            fwd = target.forward(ids, cache, position_ids=pos, attention_mask=mask, layers=layers)
            accs, host = [], []
            for r, tree in enumerate(trees):
                n = tree.num_nodes
                node_tok, node_par = tree.tokens[0], tree.parents[0]
                row_logits = fwd.logits[r, : n + 1]  # [n+1, V]
                if self.sampling.greedy:
                    acc = greedy_accept(node_tok, node_par, ancs[r], row_logits.argmax(-1))
                else:
                    qp = tree.draft_probs[0] if tree.draft_probs is not None else None
                    acc = rejection_accept(node_tok, node_par, ancs[r], logits_to_probs(row_logits, self.sampling), qp,
                                           generators[active[r]])
                accs.append(acc)
                host += [node_tok, node_par, acc.path, torch.stack([acc.length, acc.next_token, acc.recovered.long()])]
            flat = torch.cat(host).tolist()  # the step's one host transfer, for the whole batch
            outcome, at = [], 0
            for tree in trees:
                n = tree.num_nodes
                length, next_token, recovered = flat[at + 3 * n : at + 3 * n + 3]
                outcome.append((flat[at : at + n], flat[at + n : at + 2 * n], flat[at + 2 * n : at + 2 * n + length],
                                next_token, bool(recovered)))
                at += 3 * n + 3
            keeps = [acc.path[: len(o[2])] for acc, o in zip(accs, outcome)]
            lengths = lengths + 1 + torch.stack([acc.length for acc in accs])
            compact_rows(cache, [p + 1 for p in prefix], keeps, [o[2] == list(range(len(o[2]))) for o in outcome])
            sync(devs)
            verify_s = time.perf_counter() - tv
            batch.steps += 1
            batch.active.append(len(active))
            still, kept_rows = [], []
            for r, i in enumerate(active):
                gen, (node_tokens, parents, path, next_token, recovered) = gens[i], outcome[r]
                gen.verify_s += verify_s
                before = len(gen.new_tokens)
                emitted, done = _emit(gen, [node_tokens[j] for j in path] + [next_token], eos, budgets[i])
                if before <= capture_at.get(i, -1) < before + len(emitted):  # chosen at its parent's row, as generate()
                    gen.captured = fwd.logits[r, ([0] + [j + 1 for j in path])[capture_at[i] - before]].clone()
                self._count_step(gen, trees[r], emitted, parents, path, recovered)
                prefix[r] += 1 + len(path)
                if done:
                    sync(devs)
                    gen.wall_s = time.perf_counter() - t0
                    # its drafter (own caches) and its state (views of the cache buffers keep_rows replaces) go now,
                    # not when the batch ends: a finished row holds no memory while the others decode
                    del states[i]
                    drafters[i] = None
                    continue
                new = torch.cat([trees[r].tokens[0][keeps[r]], accs[r].next_token[None]])  # [A+1] == emitted
                tokens[i] = torch.cat([tokens[i], new[None]], dim=1)
                still.append(i)
                kept_rows.append(r)
            if len(still) < len(active):  # finished rows leave the batch
                prefix = [prefix[r] for r in kept_rows]
                if still:
                    index = torch.tensor(kept_rows, device=dev)
                    cache.keep_rows(index, prefix)
                    lengths = lengths.index_select(0, index)
            for r, i in enumerate(still):
                src = kept_rows[r]
                keep = keeps[src]
                rows = torch.cat([keep.new_zeros(1), keep + 1])
                states[i] = self._row_state(tokens[i], fwd.hidden[src : src + 1, rows], cache, r, prefix[r],
                                            generators[i], None if fwd.layers is None else fwd.layers[src : src + 1, rows],
                                            capacity)
                node_tokens, _, path, next_token, recovered = outcome[src]
                drafters[i].on_verified(VerifyResult(
                    accepted_nodes=path, accepted_tokens=[node_tokens[j] for j in path], next_token=next_token,
                    recovered=recovered, num_nodes=proposed[src], emitted=gens[i].new_tokens[-(len(path) + 1):],
                    hidden=states[i].hidden), states[i])
            active = still
        sync(devs)
        batch.wall_s = time.perf_counter() - t0
        return batch

