"""`make perf`: the same work done by our engine and by transformers, timed in one process on the same device.

Methods, each over the same first-turn prompts (greedy):
  ar       our engine, no drafter            vs  hf-ar     model.generate(do_sample=False)
  sd       our engine, drafter=sd (gamma)    vs  hf-sd     generate(assistant_model=<the same draft model>) with
                                                           num_assistant_tokens=gamma, constant schedule, no early stop
  pld      our engine, drafter=pld           vs  hf-pld    generate(prompt_lookup_num_tokens=, max_matching_ngram_size=)
Each repeat runs every method on every prompt (interleaved, so drift hits all alike) after a warm-up. Prints tokens/s
(mean and std over repeats), ratios, whether every output is identical, and our draft/verify/overhead split; writes
results/<experiment>/<model>__perf__<hash>/perf.json with the run header.
"""
from __future__ import annotations

import logging
import statistics
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specbench.decode.drafter import NoDrafter
from specbench.core.config import register_schema
from specbench.decode.engine import Engine, sync
from specbench.errors import SpecbenchError
from specbench.core.cli import CONF_DIR, cli, measure_and_save
from specbench.bench.run import Runner

log = logging.getLogger("specbench.perf")


def hf_generate(model, ids: list[int], max_new: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def run_perf(cfg: DictConfig) -> dict:
    runner = Runner(cfg)
    target, max_new = runner.target, runner.decoding.max_new_tokens
    if not runner.decoding.sampling().greedy:
        raise SpecbenchError("make perf compares greedy decoding: use decoding.temperature=0")
    sd = runner.make_drafter(cfg.drafter)
    pld_cfg = OmegaConf.load(CONF_DIR / "drafter" / "pld.yaml")
    pld = runner.make_drafter(pld_cfg)
    draft = sd.model
    gc = draft.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = sd.gamma, "constant", 0.0
    params = runner.decoding.sampling()
    engines = {"ar": Engine(target, NoDrafter(), params), "sd": Engine(target, sd, params),
               "pld": Engine(target, pld, params)}
    hf = {
        "hf-ar": {},
        "hf-sd": {"assistant_model": draft},
        "hf-pld": {"prompt_lookup_num_tokens": pld_cfg.num_pred_tokens, "max_matching_ngram_size": pld_cfg.max_ngram},
    }
    prompts = [runner.prompt_ids(q, 0, []) for q in runner.questions]
    dev = target.device

    def once(method: str, ids: list[int]):
        if method in engines:
            g = engines[method].generate(ids, max_new)
            return g.new_tokens, g
        sync(dev)
        t0 = time.perf_counter()
        toks = hf_generate(target.model, ids, max_new, **hf[method])
        sync(dev)
        return toks, time.perf_counter() - t0

    methods = ["ar", "hf-ar", "sd", "hf-sd", "pld", "hf-pld"]
    for m in methods:  # warm-up: kernels, allocator, transformers' generation set-up
        for _ in range(runner.bench.warmup):
            once(m, prompts[0])
    speeds = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    split = {m: {"draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "wall_s": 0.0, "steps": 0, "tokens": 0, "runs": 0}
             for m in engines}
    for rep in range(runner.bench.repeats):
        tokens = {m: 0 for m in methods}
        wall = {m: 0.0 for m in methods}
        for i, ids in enumerate(prompts):
            for m in methods:
                toks, res = once(m, ids)
                if rep == 0:
                    outputs[m].append(toks)
                tokens[m] += len(toks)
                if m in engines:
                    wall[m] += res.wall_s
                    s = split[m]
                    for k in ("draft_s", "verify_s", "prefill_s", "wall_s"):
                        s[k] += getattr(res, k)
                    s["steps"] += res.steps
                    s["tokens"] += len(toks)
                    s["runs"] += 1
                else:
                    wall[m] += res
            log.info("repeat %d prompt %d/%d done", rep + 1, i + 1, len(prompts))
        for m in methods:
            speeds[m].append(tokens[m] / wall[m])
    ref = outputs["hf-ar"]
    report = {
        "model": runner.model_cfg.name,
        "draft_model": cfg.drafter.model_path or cfg.drafter.checkpoint or f"untrained: target layers {list(cfg.drafter.module.init_layers)}",
        "gamma": sd.gamma, "prompts": len(prompts), "max_new_tokens": max_new, "repeats": runner.bench.repeats,
        "tokens_per_s": {m: {"mean": statistics.fmean(v), "std": statistics.pstdev(v)} for m, v in speeds.items()},
        "identical_to_hf_greedy": {m: outputs[m] == ref for m in methods},
        "ours_over_transformers": {m: statistics.fmean(speeds[m]) / statistics.fmean(speeds["hf-" + m]) for m in engines},
        "speedup_vs_our_ar": {m: statistics.fmean(speeds[m]) / statistics.fmean(speeds["ar"]) for m in methods},
        "split": {m: {**s, "overhead_s": s["wall_s"] - s["draft_s"] - s["verify_s"] - s["prefill_s"],
                      # the prefill's first token of every generation is not a verification step
                      "tau": (s["tokens"] - s["runs"]) / s["steps"] if s["steps"] else None}
                  for m, s in split.items()},
    }
    return report


def print_report(r: dict) -> None:
    print(f"\nmake perf: {r['model']}, draft model = {r['draft_model']} (gamma {r['gamma']}), {r['prompts']} prompts x "
          f"{r['max_new_tokens']} new tokens, {r['repeats']} repeats")
    print(f"{'method':8} {'tok/s':>14} {'vs our ar':>10} {'identical':>10}")
    for m, s in r["tokens_per_s"].items():
        print(f"{m:8} {s['mean']:8.2f} ±{s['std']:5.2f} {r['speedup_vs_our_ar'][m]:9.2f}x "
              f"{str(r['identical_to_hf_greedy'][m]):>10}")
    print("ours / transformers: " + ", ".join(f"{m} {v:.2f}x" for m, v in r["ours_over_transformers"].items()))
    print(f"{'ours':8} {'tau':>6} {'draft s':>9} {'verify s':>9} {'prefill s':>9} {'overhead s':>10}")
    for m, s in r["split"].items():
        tau = f"{s['tau']:.2f}" if s["tau"] else "-"
        print(f"{m:8} {tau:>6} {s['draft_s']:9.2f} {s['verify_s']:9.2f} {s['prefill_s']:9.2f} {s['overhead_s']:10.2f}")


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="perf", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    measure_and_save(cfg, run_perf, print_report, "perf", "specbench.perf")


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
