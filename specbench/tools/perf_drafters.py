"""`make perf-drafters`: what each drafter's decoding step costs on this device, through the shared engine.

For every drafter in `drafters` (conf/perf_drafters.yaml), over the same first-turn prompts at T=0 and interleaved
per prompt (drift hits every drafter alike), after a warm-up: tokens/s (mean and std over repeats), draft ms/step and
verify ms/step (the engine's own clocks, synchronised), tau, and the host round trips per step counted from outside
(specbench/decode/roundtrips.py) in a separate untimed pass: in the drafter's propose/on_verified, and in total (the engine's
share = total - draft). Every output is compared with the baseline's token for token, and kept in the JSON so that two
commits can be compared output for output (scripts/compare_perf_drafters.py). Writes
results/perf/<model>__drafters__<hash>/perf_drafters.json with the run header.
"""
from __future__ import annotations

import logging
import statistics

import hydra
import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from specbench.core.config import register_schema
from specbench.decode.engine import Engine, Generation
from specbench.errors import SpecbenchError
from specbench.decode.roundtrips import HostRoundTrips
from specbench.core.cli import CONF_DIR, cli, measure_and_save
from specbench.bench.run import Runner

log = logging.getLogger("specbench.perf_drafters")


class CountedDrafter:
    """A drafter seen through a second round-trip counter while it proposes and observes (the engine's counter, outside,
    sees these too)."""

    def __init__(self, inner):
        self.inner, self.needs, self.rt = inner, inner.needs, HostRoundTrips()
        self.hidden_layers = inner.hidden_layers

    def prefill(self, state):
        return self.inner.prefill(state)

    def propose(self, state):
        with self.rt:
            return self.inner.propose(state)

    def on_verified(self, state):
        with self.rt:
            return self.inner.on_verified(state)

    # the rows protocol, where the inner drafter drafts all rows at once
    @property
    def batched(self) -> bool:
        return getattr(self.inner, "batched", False)

    def prefill_rows(self, state):
        return self.inner.prefill_rows(state)

    def propose_rows(self, state):
        with self.rt:
            return self.inner.propose_rows(state)

    def on_verified_rows(self, state):
        with self.rt:
            return self.inner.on_verified_rows(state)

    def lookahead_rows(self, tokens, lengths):
        with self.rt:
            return self.inner.lookahead_rows(tokens, lengths)

    def keep_rows(self, leave):
        return self.inner.keep_rows(leave)


def count_round_trips(engine: Engine, ids: list[int] | list[list[int]], max_new: int) -> dict:
    """Host round trips per verification step: (all of a generation - a prefill-only generation) / steps, after an
    uncounted generation (one-time set-up such as a static tree's index tensors is not the hot path). `ids`: one
    prompt, or a batch of prompts decoded together (steps: the batch's forwards)."""
    inner = engine.drafter
    batch = bool(ids) and isinstance(ids[0], list)

    def generate(n: int):
        return engine.generate_batch(ids, n) if batch else engine.generate(ids, n)

    generate(max_new)
    with HostRoundTrips() as prefill_only:
        generate(1)
    counted = CountedDrafter(inner)
    engine.drafter = counted
    try:
        with HostRoundTrips() as whole:
            g = generate(max_new)
    finally:
        engine.drafter = inner
    steps = max(g.steps, 1)
    return {"steps": g.steps, "per_step": (whole.total - prefill_only.total) / steps,
            "draft_per_step": counted.rt.total / steps,
            "by_op": {k: v / steps for k, v in sorted((whole.counts - prefill_only.counts).items())}}


def run_perf_drafters(cfg: DictConfig) -> dict:
    runner = Runner(cfg)
    target, max_new = runner.target, runner.decoding.max_new_tokens
    params = runner.decoding.sampling()
    if not params.greedy:
        raise SpecbenchError("make perf-drafters compares outputs token for token: use decoding.temperature=0")
    names = ["none", *[d for d in cfg.drafters if d != "none"]]
    engines, nodes = {}, {}
    for name in names:
        node = compose(config_name="config", overrides=[f"model={cfg.model.name}", f"drafter={name}"]).drafter
        nodes[name] = OmegaConf.to_container(node, resolve=True)
        torch.manual_seed(cfg.seed)
        engines[name] = Engine(target, runner.make_drafter(node), params)
    prompts = [runner.prompt_ids(q, 0, []) for q in runner.questions]
    for name, engine in engines.items():  # warm-up: kernels, allocator, the drafters' first-call set-up
        for _ in range(runner.bench.warmup):
            engine.generate(prompts[0], min(max_new, 32))
    speed = {n: [] for n in names}
    acc = {n: {"draft_s": 0.0, "verify_s": 0.0, "wall_s": 0.0, "steps": 0, "tokens": 0, "runs": 0} for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for rep in range(runner.bench.repeats):
        tokens, wall = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
        for i, ids in enumerate(prompts):
            for name in names:
                g: Generation = engines[name].generate(ids, max_new)
                if rep == 0:
                    outputs[name].append(g.new_tokens)
                tokens[name] += len(g.new_tokens)
                wall[name] += g.wall_s
                a = acc[name]
                a["draft_s"] += g.draft_s
                a["verify_s"] += g.verify_s
                a["wall_s"] += g.wall_s
                a["steps"] += g.steps
                a["tokens"] += len(g.new_tokens)
                a["runs"] += 1
            log.info("repeat %d prompt %d/%d done", rep + 1, i + 1, len(prompts))
        for name in names:
            speed[name].append(tokens[name] / wall[name])
    trips = {name: count_round_trips(engines[name], prompts[0], max_new) for name in names}
    base = statistics.fmean(speed["none"])
    rows = {}
    for name in names:
        a = acc[name]
        rows[name] = {
            "tokens_per_s": {"mean": statistics.fmean(speed[name]), "std": statistics.pstdev(speed[name])},
            "speedup": statistics.fmean(speed[name]) / base,
            "draft_ms_per_step": 1e3 * a["draft_s"] / a["steps"] if a["steps"] else None,
            "verify_ms_per_step": 1e3 * a["verify_s"] / a["steps"] if a["steps"] else None,
            # the prefill's first token of every generation is not a verification step
            "tau": (a["tokens"] - a["runs"]) / a["steps"] if a["steps"] else None,
            "round_trips": trips[name],
            "identical_to_baseline": outputs[name] == outputs["none"],
            "outputs": outputs[name],
            "drafter": nodes[name],
        }
    return {"model": runner.model_cfg.name, "prompts": len(prompts), "max_new_tokens": max_new,
            "repeats": runner.bench.repeats, "drafters": rows}


def print_report(r: dict) -> None:
    print(f"\nmake perf-drafters: {r['model']}, {r['prompts']} prompts x {r['max_new_tokens']} new tokens, "
          f"{r['repeats']} repeats, T=0")
    print(f"{'drafter':14} {'tok/s':>14} {'speedup':>8} {'tau':>5} {'draft ms':>9} {'verify ms':>9} "
          f"{'trips/step':>10} {'(draft)':>8} {'identical':>9}")
    for name, s in r["drafters"].items():
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rt = s["round_trips"]
        print(f"{name:14} {s['tokens_per_s']['mean']:8.2f} ±{s['tokens_per_s']['std']:5.2f} {s['speedup']:7.2f}x "
              f"{f(s['tau']):>5} {f(s['draft_ms_per_step']):>9} {f(s['verify_ms_per_step']):>9} "
              f"{rt['per_step']:10.1f} {rt['draft_per_step']:8.1f} {str(s['identical_to_baseline']):>9}")


register_schema()


@hydra.main(config_path=str(CONF_DIR), config_name="perf_drafters", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    measure_and_save(cfg, run_perf_drafters, print_report, "drafters", "specbench.perf_drafters")


def main() -> None:
    cli(_main)


if __name__ == "__main__":
    main()
