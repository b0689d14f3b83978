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

from specbench.drafter import HIDDEN, KV, LAYERS, Drafter
from specbench.sampling import logits_to_probs, sample
from specbench.target import TargetModel, cache_kv, compact_cache
from specbench.tree import ancestor_matrix, is_chain, node_depths
from specbench.types import DraftTree, SamplingParams, TargetState, VerifyResult
from specbench.verify import greedy_accept, rejection_accept


def sync(device: torch.device | tuple[torch.device, ...]) -> None:
    """Wait for queued device work, so that the clock measures it: on every device a target spread over several
    (model.device_map) computes on, not only the engine's."""
    for d in device if isinstance(device, tuple) else (device,):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@dataclass
class StepTrace:
    """One verification step as the tree cost model reads it (Engine(trace=True); specbench/costmodel.py)."""

    parents: list[int]  # the drafted tree, -1 = the root
    priority: list[float] | None  # the policy's preference per node (DraftTree.priority), None = node order
    path: list[int]  # the accepted nodes, root's child first


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
    # the node below which it was accepted or drawn); None otherwise (specbench/divergence.py replays with it)
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


class Engine:
    def __init__(self, target: TargetModel, drafter: Drafter, sampling: SamplingParams, trace: bool = False):
        """trace=True keeps every step's tree and accepted path (one more host read per step: calibration only)."""
        self.target, self.drafter, self.sampling, self.trace = target, drafter, sampling, trace

    def _state(self, tokens: torch.Tensor, hidden: torch.Tensor | None, cache, generator,
               layers: torch.Tensor | None = None) -> TargetState:
        needs = self.drafter.needs
        return TargetState(
            tokens=tokens,
            hidden=hidden if HIDDEN in needs else None,
            kv=cache_kv(cache, self.target.device) if KV in needs else None,
            layers=layers if LAYERS in needs else None,
            sampling=self.sampling,
            generator=generator,
        )

    def _first_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.sampling.greedy:
            return int(logits.argmax(-1).item())
        return int(sample(logits_to_probs(logits, self.sampling), generator).item())

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
        cache = target.new_cache(context or len(prompt_ids) + max_new_tokens + 256)
        layers = tuple(drafter.hidden_layers) if LAYERS in drafter.needs else ()  # EAGLE-3's low/middle/high
        fwd = target.prefill(prompt, cache, layers=layers)
        first = self._first_token(fwd.logits[0, -1], generator)
        tokens = torch.cat([prompt, torch.tensor([[first]], device=dev)], dim=1)
        out = [first]
        state = self._state(tokens, fwd.hidden, cache, generator, fwd.layers)
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
            # emit the accepted tokens and the bonus/recovered one, stopping at EOS or the token budget
            emitted: list[int] = []
            for tok in [node_tokens[i] for i in path] + [next_token]:
                emitted.append(tok)
                if tok in eos:
                    gen.stopped_by, done = "eos", True
                    break
                if len(out) + len(emitted) >= max_new_tokens:
                    done = True
                    break
            if capture_at is not None and len(out) <= capture_at < len(out) + len(emitted):
                # emitted token t was chosen at the row of its parent: the root (row 0), then accepted node path[t-1]
                choosers = [0] + [i + 1 for i in path]
                gen.captured = logits[choosers[capture_at - len(out)]].clone()
            out.extend(emitted)
            gen.steps += 1
            gen.tokens_per_step.append(len(emitted))
            gen.tree_sizes.append(n)
            gen.recovered += int(recovered)
            gen.chain &= is_chain(parents)
            if self.trace:
                priority = tree.priority[0].tolist() if tree.priority is not None else None
                gen.trace.append(StepTrace(parents, priority, path))
            _count_depths(gen, parents, path)
            if done:
                break
            rows = torch.cat([keep.new_zeros(1), keep + 1])  # root + accepted nodes are now in the target cache
            new = torch.cat([node_tok[keep], acc.next_token[None]])  # [A+1] == emitted (not cut: not done)
            tokens = torch.cat([tokens, new[None]], dim=1)
            state = self._state(tokens, fwd.hidden[:, rows], cache, generator,
                                None if fwd.layers is None else fwd.layers[:, rows])
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
