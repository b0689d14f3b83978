"""`make limit`: how far the engine's baseline is from the device's limit (issue 30), per device and dtype.

  baseline   our engine with no drafter, greedy, `decoding.max_new_tokens` after each chat-templated prompt: ms per
             decoded token ((wall - prefill) / (new tokens - 1)) over the prompts, the best of `bench.repeats`, on
             the cache every decode runs on (eager: the preallocated one; the records of before issue 77 also timed
             transformers' DynamicCache, which the engine no longer decodes on); the repeats interleave the paths and
             the bare loop (a shared host drifts over minutes)
  bare       the same weight matrices (every 2-D weight of the decoder layers and the LM head; the embedding is a row
             lookup) applied to one token's activations by torch.nn.functional.linear in a bare loop: ms per token,
             best of repeats: what reading and multiplying the weights alone costs here
  overhead   1 - bare / baseline: the share of a baseline step that is neither a weight read nor a matmul (attention
             over the cache, norms, RoPE, residuals, the modules' Python, the mask and cache machinery)
  compiled   the same baseline with model.compile (torch.compile of the target's tree forward over a static cache;
             CUDA graphs on CUDA): its graph is built in the warm-up, then timed as the eager rows
Writes results/limit/<model>__limit__<hash>/limit.json with the run header.
    python -m specbench.limit model=smollm2-135m decoding.max_new_tokens=128 bench.repeats=3
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from specbench.core.cli import entry, measure_and_save
from specbench.decode.drafter import NoDrafter
from specbench.decode.engine import Engine, sync
from specbench.errors import SpecbenchError
from specbench.bench.run import Runner
from specbench.decode.target import TargetModel
from specbench.decode.types import SamplingParams

log = logging.getLogger("specbench.limit")


def weight_matrices(target: TargetModel) -> list[torch.Tensor]:
    """Every 2-D weight a decoding step multiplies by: the decoder layers' and the LM head's (not the embedding)."""
    mats = [p for p in target.decoder.layers.parameters() if p.dim() == 2]
    return mats + [target.lm_head.weight]


@torch.inference_mode()
def bare_ms(target: TargetModel, repeats: int, loops: int = 20) -> float:
    """ms per token of F.linear over every weight matrix, one token's activations, in a bare loop (best of repeats)."""
    mats = weight_matrices(target)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype) for w in mats}
    for w in mats:  # warm-up
        F.linear(xs[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        sync(target.devices)
        t0 = time.perf_counter()
        for _ in range(loops):
            for w in mats:
                F.linear(xs[w.shape[1]], w)
        sync(target.devices)
        best = min(best, (time.perf_counter() - t0) / loops)
    return 1e3 * best


def baseline_ms(engine: Engine, prompts: list[list[int]], max_new: int) -> float:
    """Our baseline's ms per decoded token over the prompts (prefill excluded), one pass."""
    s = n = 0.0
    for ids in prompts:
        g = engine.generate(ids, max_new)
        s += g.wall_s - g.prefill_s
        n += len(g.new_tokens) - 1
    return 1e3 * s / n


def run_limit(cfg: DictConfig) -> dict:
    runner = Runner(cfg)
    base = runner.target
    prompts = [runner.prompt_ids(q, 0, []) for q in runner.questions]
    mats = weight_matrices(base)
    report = {"model": runner.model_cfg.name, "dtype": str(base.dtype).removeprefix("torch."),
              "device": str(base.device), "prompts": len(prompts), "max_new_tokens": runner.decoding.max_new_tokens,
              "repeats": runner.bench.repeats, "weight_matrices": len(mats),
              "weight_bytes": sum(w.numel() * w.element_size() for w in mats),
              "eager": {}}
    max_new = runner.decoding.max_new_tokens
    if max_new < 2:
        raise SpecbenchError("make limit needs decoding.max_new_tokens >= 2 (decoded tokens after the first)")
    # eager: the engine's one cache, the preallocated one (report["eager"] keyed by cache, as the records of before)
    paths = {"preallocated": TargetModel(base.model, base.tokenizer, base.device, base.name)}
    paths["compiled"] = TargetModel(base.model, base.tokenizer, base.device, base.name, compile=True)
    engines = {k: Engine(t, NoDrafter(), SamplingParams()) for k, t in paths.items()}
    for name, engine in engines.items():
        for _ in range(runner.bench.warmup):
            engine.generate(prompts[0], max_new)
        if name == "compiled":  # every prompt once: its graphs per context block and its cache at the largest size
            baseline_ms(engine, prompts, max_new)
    # interleaved: each repeat times the bare loop and every path in turn, so a shared host's drift over minutes
    # reaches them alike; the best of the repeats per path
    best = {k: float("inf") for k in ["bare", *engines]}
    for r in range(runner.bench.repeats):
        best["bare"] = min(best["bare"], bare_ms(base, 1))
        for name, engine in engines.items():
            best[name] = min(best[name], baseline_ms(engine, prompts, max_new))
        log.info("repeat %d: %s", r + 1, ", ".join(f"{k} {v:.2f} ms" for k, v in best.items()))
    report["bare_ms_per_token"] = best["bare"]
    for name in engines:
        row = {"baseline_ms_per_token": best[name], "overhead_share": 1.0 - best["bare"] / best[name]}
        if name == "compiled":
            report["compiled"] = row
        else:
            report["eager"][name] = row
    return report


def print_report(r: dict) -> None:
    print(f"\nmake limit: {r['model']} ({r['dtype']}, {r['device']}), {r['prompts']} prompts x {r['max_new_tokens']} new "
          f"tokens, best of {r['repeats']}")
    print(f"bare: {r['weight_matrices']} weight matrices, {r['weight_bytes'] / 2**20:.0f} MiB: "
          f"{r['bare_ms_per_token']:.2f} ms per token")
    print(f"{'path':24} {'ms/token':>9} {'overhead':>9}")
    for kind, row in r["eager"].items():
        print(f"{'eager, ' + kind + ' cache':24} {row['baseline_ms_per_token']:9.2f} {row['overhead_share']:8.0%}")
    row = r["compiled"]
    print(f"{'compiled, static cache':24} {row['baseline_ms_per_token']:9.2f} {row['overhead_share']:8.0%}")


main = entry(lambda cfg: measure_and_save(cfg, run_limit, print_report, "limit", "specbench.limit"), "limit")

if __name__ == "__main__":
    main()
