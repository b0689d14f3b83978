"""Draft trees sized for the device: a cost model measured on it, and the tree that maximises predicted tokens/s.

The papers size their trees for an A100, where verifying 60 tokens costs about one forward; on a 2-core CPU it costs
several. `tree=auto` (conf/tree/auto.yaml) picks, per drafter, the depth d, top-k k and node count n of its own tree policy
(`tree.base`: the drafter's paper tree, `paper_tree`; k from `tree.topks` and the base's) that maximise predicted
tokens/s on this device. A static list (EAGLE-1's) is cut to its first n paths of depth <= d; drafters without a tree
policy tune their own drafts the same way (Drafter.own_tree: pld's and sd's chain length, Medusa's sparse tree):

  cost (measured here, cached per device / model / dtype / drafter weights, `calibrate`):
    t_verify(Q)   one target forward over Q new tokens (the root + Q-1 nodes, tree mask) behind the run's own mean
                  context (its prompts + half its new tokens), cache cropped back: median of `repeats` after a
                  warm-up; linear between Q's; and the prefill of the run's mean prompt
    t_draft(d, k) the drafter's draft time per step with its policy cut at depth d and top-k k (short decodes of the
                  calibration prompts) at `timed_depths` depths per k (the first, the last, evenly between), linear
                  between them (a level is one forward of the drafter), times the context scale: the base tree's
                  draft time per step on the run prompt nearest the run's mean length over that on a calibration
                  prompt (a drafter attending over its context drafts slower behind a long prompt)
    overhead      the engine's own time per step (wall - prefill - draft - verify) / steps, from the base tree's
                  timing decode (the policy cut at its own depth and width is the base); prefill per prompt
                  (at decoding.batch_size B > 1, t_draft, overhead and prefill are the batch's: B calibration prompts
                  decoded together, every row drafted in the same forwards)
  acceptance (one traced decode of the calibration prompts with the base tree, Engine(trace=True)):
    each step's tree with its policy's priority (DraftTree.priority: cumulative draft log-probability) and the
    accepted path. The tree the policy grows with (d, k, n) is replayed on the recorded one by those priorities
    (kept_nodes: the root's best k children, each frontier node's best k children, the best k of them as the next
    frontier, the best n of all; a static list's first n paths of depth <= d), and its accepted length is the longest
    prefix of the recorded path inside it. Exact where the smaller tree lies inside the recorded one (greedy); where
    the base's rerank dropped nodes the smaller tree would hold, a lower bound (tests/test_costmodel.py).
  prediction for T new tokens of the run:
    tokens/s = T / (prefill + (T - 1) / tau(d,k,n) * (t_draft(d,k) + t_verify(n+1) + overhead))
    and the baseline's T / (prefill + (T - 1) * (t_verify(1) + overhead_ar)).
Calibration questions come from a set that no experiment scores (`tree.calibration.dataset`, default alpaca).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specbench.decode.drafter import Drafter, NoDrafter
from specbench.decode.engine import BatchGeneration, Engine, Generation, StepTrace, sync
from specbench.errors import SpecbenchError
from specbench.core.records import atomic_write_json
from specbench.decode.tree import ancestor_matrix, batch_tree_mask, node_depths, tree_position_ids
from specbench.decode.types import SamplingParams

log = logging.getLogger(__name__)


# ---- acceptance of a smaller tree of the same policy, from a traced decode -----------------------------------------
def _order(pri: list[float]):
    return lambda i: (-pri[i], i)  # higher priority first, ties to the earlier node (the policies' stable order)


def _traced_step(step: StepTrace) -> dict:
    """A step as the calibration file keeps it: the tree and its accepted path, not the drafted tokens."""
    return {k: v for k, v in asdict(step).items() if k != "tokens"}


def kept_nodes(step: StepTrace, depth: int, nodes: int, topk: int | None = None) -> set[int]:
    """The nodes of the tree the policy grows with `depth` levels, `nodes` nodes and (dynamic trees) `topk`: replayed
    on the recorded tree by its priorities. A dynamic tree keeps the root's best `topk` children, expands its frontier
    into each node's best `topk` children, takes the best `topk` of those as the next frontier, and finally keeps the
    best `nodes` of everything expanded (DynamicTree.grow); a static list (no topk) keeps its first `nodes` paths of
    depth <= depth; without priorities, node order (a chain)."""
    pri = step.priority if step.priority is not None else [-float(i) for i in range(len(step.parents))]
    key = _order(pri)
    if topk is None:
        depths = node_depths(step.parents)
        return set(sorted((i for i, d in enumerate(depths) if d <= depth), key=key)[:nodes])
    children: dict[int, list[int]] = {}
    for i, p in enumerate(step.parents):
        children.setdefault(p, []).append(i)
    frontier = sorted(children.get(-1, []), key=key)[:topk]
    expanded = list(frontier)
    for _ in range(1, depth):
        cand = [c for f in frontier for c in sorted(children.get(f, []), key=key)[:topk]]
        expanded += cand
        frontier = sorted(cand, key=key)[:topk]
    return set(sorted(expanded, key=key)[:nodes])


def accepted_within(step: StepTrace, kept: set[int]) -> int:
    n = 0
    for node in step.path:
        if node not in kept:
            break
        n += 1
    return n


def predicted_tau(trace: list[StepTrace], depth: int, nodes: int, topk: int | None = None) -> float:
    """Mean tokens per verification step (accepted + the bonus one) of the smaller tree over the traced steps."""
    return statistics.fmean(1 + accepted_within(s, kept_nodes(s, depth, nodes, topk)) for s in trace)


# ---- the cost model --------------------------------------------------------------------------------------------------
@dataclass
class TargetCost:
    prompt: int  # the run's mean prompt length
    prefill_s: float  # median seconds of a prefill of that length
    context: int  # tokens in the cache when verifying: the prompt + half the run's new tokens
    sizes: list[int]  # Q: tokens per verification forward (root included)
    seconds: list[float]  # median seconds per forward at each Q
    batch: int = 1  # rows per forward (decoding.batch_size): Q tokens in each

    def verify(self, q: int) -> float:
        return float(np.interp(q, self.sizes, self.seconds))


@dataclass
class DrafterCost:
    base: dict  # the base tree (conf/tree)
    draft: list[list[float]]  # [depth, topk (0 = static), seconds per step] with the policy cut there: the measured
    # depths (timed_depths of them per topk; every depth in files written before), the rest read by `draft_s`
    overhead_s: float  # per step, engine and drafter bookkeeping outside draft and verify
    prefill_s: float  # per prompt
    ar_overhead_s: float  # the baseline's per step, outside its one-token forward
    ar_prefill_s: float
    trace: list[dict]  # StepTrace as dicts: the base tree's steps on the calibration prompts
    # rows decoded together when draft, overhead and prefill were timed: at B > 1 they are the batch's per step (every
    # row drafted in the same forwards), not one row's (1: files written before batched drafting, or batch 1)
    batch: int = 1

    def draft_s(self, depth: int, topk: int) -> float:
        """The draft seconds per step at (depth, topk): measured, or linear between the measured depths of that topk
        (each level of a tree policy is one drafter forward; tests/test_costmodel.py)."""
        measured = sorted((int(d), s) for d, k, s in self.draft if int(k) == topk)
        if not measured or not measured[0][0] <= depth <= measured[-1][0]:
            raise SpecbenchError(f"cost model: no draft time measured around depth {depth}, top-k {topk} "
                                 f"(measured: {[(d, int(k)) for d, k, _ in self.draft]})")
        return float(np.interp(depth, *zip(*measured)))

    def widths(self) -> list[int]:
        return sorted({int(k) for _, k, _ in self.draft})


@dataclass
class Choice:
    depth: int
    topk: int  # 0 for a static list
    nodes: int
    tau: float
    tokens_per_s: float
    speedup: float  # predicted, against the baseline's predicted tokens/s


def predict(target: TargetCost, drafter: DrafterCost, depth: int, topk: int, nodes: int, new_tokens: int,
            trace: list[StepTrace], draft_scale: float = 1.0) -> Choice:
    """Predicted tokens/s of the tree cut at (depth, topk, nodes). At batch B (target.batch) one forward verifies
    B x (nodes + 1) tokens and the batch's throughput is B x T over the step time. The draft, overhead and prefill
    costs are the batch's when the drafter was calibrated at that B (every row drafted in the same forwards); a cost
    file timed at batch 1 is charged B times (rows drafted one after another). (A model: it assumes every row takes
    the same steps, where a real batch runs until its slowest row, shrinking as rows finish.)"""
    b = target.batch
    rows = 1 if drafter.batch == b else b  # how many times a calibrated per-step cost is paid per step
    tau = predicted_tau(trace, depth, nodes, topk or None)
    draft = drafter.draft_s(depth, topk) * draft_scale
    t_step = rows * draft + target.verify(nodes + 1) + rows * drafter.overhead_s
    # the run's prompt: the target's prefill at its length, plus what the drafter adds to a prefill (calibration)
    prefill = target.prefill_s + rows * max(0.0, drafter.prefill_s - drafter.ar_prefill_s)
    tps = b * new_tokens / (prefill + (new_tokens - 1) / tau * t_step)
    ar = b * new_tokens / (target.prefill_s + (new_tokens - 1) * (target.verify(1) + rows * drafter.ar_overhead_s))
    return Choice(depth, topk, nodes, tau, tps, tps / ar)


def candidates(base: dict, drafter: DrafterCost) -> list[tuple[int, int, int]]:
    """(depth, topk, nodes) of the base policy: every depth up to the base's at each top-k whose draft time was
    measured; nodes from depth (a path reaching the last level) to what that depth and top-k can hold, at most the
    base's."""
    out = []
    for d, k in ((d, k) for k in drafter.widths() for d in range(1, base_depth(base) + 1)):
        most = (sum(len(p) <= d for p in base["paths"]) if k == 0  # a static list cut at depth d holds no more
                else min(base_nodes(base), k + (d - 1) * k * k))
        out += [(d, k, n) for n in range(d, most + 1)]
    return out


def best_tree(target: TargetCost, drafter: DrafterCost, new_tokens: int,
              draft_scale: float = 1.0) -> tuple[Choice, list[Choice]]:
    """The (depth, topk, nodes) of the base policy with the highest predicted tokens/s, and every candidate's."""
    trace = [StepTrace(**s) for s in drafter.trace]
    grid = [predict(target, drafter, d, k, n, new_tokens, trace, draft_scale)
            for d, k, n in candidates(drafter.base, drafter)]
    return max(grid, key=lambda c: (c.tokens_per_s, -c.nodes)), grid


def concrete_tree(base: dict, depth: int, nodes: int, topk: int = 0) -> dict:
    """The base policy cut to `depth` levels, `nodes` nodes and (dynamic) `topk`, as a conf/tree dict."""
    if base["kind"] == "dynamic":
        counted = base.get("root_counted", True)  # DynamicTree's default: total_tokens includes the root
        return {"kind": "dynamic", "depth": depth, "topk": topk or base["topk"], "total_tokens": nodes + counted,
                "root_counted": counted}
    if base["kind"] == "static":
        paths = [p for p in base["paths"] if len(p) <= depth][:nodes]
        return {"kind": "static", "name": f"{base.get('name', 'static')}[d{depth},n{nodes}]", "paths": paths}
    raise SpecbenchError(f"tree=auto: base tree kind {base['kind']!r} is not dynamic or static")


def base_depth(base: dict) -> int:
    return base["depth"] if base["kind"] == "dynamic" else max(len(p) for p in base["paths"])


def base_nodes(base: dict) -> int:
    """Drafted nodes (the root not counted)."""
    if base["kind"] == "dynamic":
        return base["total_tokens"] - base.get("root_counted", True)
    return len(base["paths"])


# ---- measuring -------------------------------------------------------------------------------------------------------
VERIFY_REPEATS = 7  # timed rounds of the target's forwards per calibration (after one warm-up round)

@torch.inference_mode()
def time_verify(target, prompt: int, context: int, sizes: list[int], repeats: int = VERIFY_REPEATS,
                batch: int = 1) -> TargetCost:
    """One target forward over `batch` rows of Q new tokens each, behind `context` cached ones, per Q in `sizes`, on
    the path the engine takes at every B (a preallocated cache, or model.compile's static one of the batch's bucket,
    a per-row 4D mask and positions; none for a lone row's one token, as the engine's lone chain). The sizes are timed
    in rounds (each round one forward per size, the first round a warm-up), so that a host whose speed drifts during
    the calibration shifts every size alike: the model reads verify(Q) against verify(1), and timing the sizes one
    after another once made that ratio the drift's (AMD EPYC, 2026-11-25: Q = 8 timed 91, 116 and 128 ms in three
    calibrations of one context, the 91 paired with a slow Q = 1)."""
    dev = target.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (batch, context), generator=g).to(dev)
    room = context + max(sizes)

    def new_cache():
        return target.new_cache(room, batch=batch, ragged=True)

    prefills = []
    for _ in range(3):  # the prefill of a run's prompt
        sync(dev)
        t0 = time.perf_counter()
        target.prefill(ids[:, :prompt], new_cache())
        sync(dev)
        prefills.append(time.perf_counter() - t0)
    cache = new_cache()
    target.prefill(ids, cache)
    tokens = {q: torch.randint(0, target.vocab_size, (batch, q - 1), generator=g).to(dev) for q in sizes}
    # a star: the tree mask, not the causal one
    anc = {q: ancestor_matrix(torch.full((q - 1,), -1, dtype=torch.long, device=dev)) for q in sizes}
    times: dict[int, list[float]] = {q: [] for q in sizes}
    for r in range(repeats + 1):  # round 0 is the warm-up
        for q in sizes:
            sync(dev)
            t0 = time.perf_counter()
            # as generate_batch: every row's mask and positions built per step, on the device
            lengths = torch.full((batch,), context, device=dev)
            mask = (None if batch == 1 and q == 1 else
                    batch_tree_mask(anc[q][None].expand(batch, q, q), lengths, context + q, target.dtype))
            pos = tree_position_ids(anc[q], context).expand(batch, q)
            target.forward(torch.cat([ids[:, -1:], tokens[q]], 1), cache, position_ids=pos, attention_mask=mask)
            sync(dev)
            if r:
                times[q].append(time.perf_counter() - t0)
            cache.crop(context - cache.get_seq_length())  # transformers 5: a negative count
    seconds = [statistics.median(times[q]) for q in sizes]
    return TargetCost(prompt, statistics.median(prefills), context, sizes, seconds, batch)


def _per_step(gens: list[Generation]) -> tuple[float, float, float, float]:
    """(draft s, overhead s per step; prefill s per prompt; steps)."""
    steps = sum(g.steps for g in gens)
    draft = sum(g.draft_s for g in gens) / steps
    over = sum(g.wall_s - g.prefill_s - g.draft_s - g.verify_s for g in gens) / steps
    return draft, over, statistics.fmean(g.prefill_s for g in gens), steps


def _batch_per_step(batch: BatchGeneration) -> tuple[float, float, float, int]:
    """_per_step of one batch: the batch's draft s and overhead s per step, its prefill s, its steps."""
    steps = max(1, batch.steps)
    return (batch.draft_s / steps, (batch.wall_s - batch.prefill_s - batch.draft_s - batch.verify_s) / steps,
            batch.prefill_s, batch.steps)


def timed_depths(depth: int, count: int) -> list[int]:
    """The depths of a policy `depth` levels deep whose draft time is measured: the first, the last and evenly
    between, `count` in all (every depth when it has no more)."""
    return sorted({round(float(d)) for d in np.linspace(1, depth, max(2, min(count, depth)))})


def calibrate_drafter(target, make_drafter: Callable[[dict], Drafter], base: dict, prompts: list[list[int]],
                      new_tokens: int, topks: list[int], batch: int = 1, depths: int = 3) -> DrafterCost:
    """The drafter's costs on this device. At batch B > 1 the draft, overhead and prefill are timed on B calibration
    prompts decoded together (the prompts repeated to B rows), as the run decodes; acceptance is traced at batch 1
    either way (a row accepts what it accepts alone). The draft time is measured at `depths` depths per top-k
    (timed_depths); the base tree's own timing decode gives the overhead and prefill."""
    greedy = SamplingParams()
    Engine(target, make_drafter(base), greedy).generate(prompts[0], 8)  # warm-up
    traced = [Engine(target, make_drafter(base), greedy, trace=True).generate(p, new_tokens) for p in prompts]
    rows = [prompts[i % len(prompts)] for i in range(batch)]

    def per_step(drafter: Drafter, tokens: int) -> tuple[float, float, float, int]:
        return _batch_per_step(Engine(target, drafter, greedy).generate_batch(rows, tokens))

    Engine(target, make_drafter(base), greedy).generate_batch(rows, 8)  # warm-up at this B
    dynamic = base["kind"] == "dynamic"
    widths = sorted({k for k in topks if k <= base["topk"]} | {base["topk"]}) if dynamic else [0]
    top, deepest = (base["topk"] if dynamic else 0), base_depth(base)
    draft, overhead, prefill = [], None, None
    for k in widths:
        for d in timed_depths(deepest, depths):  # the policy cut at depth d (all its nodes): its draft time
            t_draft, over, pre, _ = per_step(make_drafter(concrete_tree(base, d, base_nodes(base), k)),
                                             min(new_tokens, 24))
            draft.append([d, k, t_draft])
            if (d, k) == (deepest, top):  # the cut that is the base tree itself
                overhead, prefill = over, pre
    _, ar_over, ar_prefill, _ = per_step(NoDrafter(), min(new_tokens, 24))
    return DrafterCost(base, draft, overhead, prefill, ar_overhead_s=ar_over, ar_prefill_s=ar_prefill,
                       trace=[_traced_step(s) for g in traced for s in g.trace], batch=batch)


@dataclass
class ContextScale:
    prompt: int  # the run prompt's length
    calibration_s: float  # the base tree's draft seconds per step on a calibration prompt
    run_s: float  # ... on the run prompt
    scale: float  # run_s / calibration_s: what every t_draft(d, k) is multiplied by for this run


def context_scale(target, make_drafter: Callable[[dict], Drafter], base: dict, calibration: list[int],
                  run: list[int], new_tokens: int = 16) -> ContextScale:
    """The base tree's draft time per step behind the run's prompt over behind a calibration prompt (one short
    decode each, after a warm-up)."""
    greedy = SamplingParams()
    Engine(target, make_drafter(base), greedy).generate(run, 4)  # warm-up at the longer context
    cal = _per_step([Engine(target, make_drafter(base), greedy).generate(calibration, new_tokens)])[0]
    at_run = _per_step([Engine(target, make_drafter(base), greedy).generate(run, new_tokens)])[0]
    return ContextScale(len(run), cal, at_run, at_run / cal if cal > 0 else 1.0)


def device_key(device: torch.device) -> str:
    from specbench.core.envinfo import device_info

    info = device_info(device)
    name = info.get("gpu") or info.get("cpu") or device.type
    return "".join(c if c.isalnum() else "-" for c in f"{name}-{torch.get_num_threads()}t").strip("-")


def cache_path(root: str, device: torch.device, model: str, dtype: torch.dtype, what: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return (Path(os.path.expanduser(root)) / "costmodel" / device_key(device)
            / f"{model}__{str(dtype).removeprefix('torch.')}" / f"{what}__{digest}.json")


def cached(path: Path, make: Callable[[], object], cls: type):
    if path.is_file():
        return cls(**json.loads(path.read_text())), path
    log.info("calibrating %s (cached in %s)", path.stem, path)
    obj = make()
    atomic_write_json(path, asdict(obj))
    return obj, path


@dataclass
class AutoConfig:
    """conf/tree/auto.yaml."""
    base: dict  # the policy whose depth and node count are tuned (a conf/tree dict: dynamic or static)
    dataset: str = "alpaca"  # calibration questions: a set no experiment scores
    questions: int = 3
    new_tokens: int = 48
    topks: list[int] = field(default_factory=lambda: [1, 2, 4])  # widths tried besides the base's (dynamic)
    timed_depths: int = 3  # depths whose draft time is measured per width (the rest linear between; timed_depths)


def choose_tree(target, auto: AutoConfig, make_drafter: Callable[[dict], Drafter], drafter_key: dict,
                prompts: list[list[int]], run_prompts: list[list[int]], run_tokens: int, cache_root: str,
                model: str, batch: int = 1) -> tuple[dict, dict]:
    """The tuned tree (a conf/tree dict) and the record that explains it (written into run.json). `prompts`: the
    calibration questions (acceptance, draft cost); `run_prompts`: the run's own, whose length sets the target's
    prefill and verification costs (a long-prompt set makes every verification dearer). `batch`: the run's
    decoding.batch_size, at which the target's forwards are timed and the throughput predicted."""
    base = auto.base
    prompt = int(statistics.fmean(len(p) for p in run_prompts))
    context = prompt + run_tokens // 2
    sizes = sorted({q for q in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96) if q <= base_nodes(base) + 1}
                   | {base_nodes(base) + 1})
    # the target's path changes its costs: a compile or a batch names its own files (so did model.cache=preallocated,
    # gone with issue 77: every path's cache is the preallocated one; True: inductor's, another backend's name keeps
    # its timings apart)
    path = {**({"compile": target.compiled.backend} if target.compiled is not None else {}),
            **({"batch": batch} if batch > 1 else {}),
            # batch 1 on the batch's path (issue 77): the files of decoding.ragged=true's, the lone path's apart
            **({"ragged": True} if batch == 1 else {})}
    tpath = cache_path(cache_root, target.device, model, target.dtype, "target",
                       {"prompt": prompt, "context": context, "sizes": sizes, **path,
                        "timing": f"rounds of every size, median of {VERIFY_REPEATS}"})  # older files timed sizes in turn
    tcost, tpath = cached(tpath, lambda: time_verify(target, prompt, context, sizes, batch=batch),
                          TargetCost)
    key = {**drafter_key, "base": base, "calibration": asdict(auto) | {"prompts": prompts}, **path}
    key["draft_timed"] = "batch"  # the draft timed at this B, all rows in the same forwards (older files: one row's)
    dpath = cache_path(cache_root, target.device, model, target.dtype, drafter_key.get("name", "drafter"), key)
    dcost, dpath = cached(dpath, lambda: calibrate_drafter(target, make_drafter, base, prompts, auto.new_tokens,
                                                          auto.topks, batch, auto.timed_depths),
                          DrafterCost)
    typical = min(run_prompts, key=lambda p: abs(len(p) - prompt))  # the run prompt nearest the mean length
    spath = cache_path(cache_root, target.device, model, target.dtype, f"{drafter_key.get('name', 'drafter')}-context",
                       {**key, "run_prompt": typical})
    scale, spath = cached(spath, lambda: context_scale(target, make_drafter, base, prompts[0], typical), ContextScale)
    choice, grid = best_tree(tcost, dcost, run_tokens, scale.scale)
    trace = [StepTrace(**s) for s in dcost.trace]
    paper = predict(tcost, dcost, base_depth(base), base.get("topk", 0) if base["kind"] == "dynamic" else 0,
                    base_nodes(base), run_tokens, trace, scale.scale)
    record = {"chosen": concrete_tree(base, choice.depth, choice.nodes, choice.topk), "predicted": asdict(choice),
              "base": base, "base_predicted": asdict(paper), "cost_files": [str(tpath), str(dpath), str(spath)],
              "draft_context_scale": asdict(scale),
              "verify_s": dict(zip(tcost.sizes, tcost.seconds)), "draft_s": {f"depth {int(d)}, top-k {int(k)}": t for d, k, t in dcost.draft},
              "overhead_s": dcost.overhead_s, "calibration": asdict(auto), "batch": batch,
              # the best prediction at each node count (over depths): the figure's curve
              "curve": {n: max(c.tokens_per_s for c in grid if c.nodes == n) for n in sorted({c.nodes for c in grid})},
              "baseline_predicted_tokens_per_s": choice.tokens_per_s / choice.speedup}
    return record["chosen"], record
