"""One greedy generation of a drafter on the embedded target, profiled after two warm-ups: draft and verify ms per
step and where the time goes, by Python function (cProfile) or, with `ops`, by torch operator (torch.profiler: the
matmuls, a compiled graph's fused kernels, attention, dynamo's guard checks). `compile`: with model.compile=true.
The before/after alternation of docs/engine.md ran it at each commit in turn; its compiled-step breakdown is

    python scripts/profile_step.py none 128 compile ops
    python scripts/profile_step.py [drafter=eagle2] [max_new_tokens=64] [compile] [ops]
"""
from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from specbench.core.config import register_schema
from specbench.decode.engine import Engine
from specbench.bench.run import Runner


def main(drafter: str = "eagle2", max_new: int = 64, compiled: bool = False, ops: bool = False) -> None:
    register_schema()
    conf = Path(__file__).resolve().parents[1] / "conf"
    overrides = [f"drafter={drafter}", "dataset.limit=1", *(["model.compile=true"] if compiled else [])]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    runner = Runner(cfg)
    engine = Engine(runner.target, runner.make_drafter(cfg.drafter), runner.decoding.sampling())
    ids = runner.prompt_ids(runner.questions[0], 0, [])
    for _ in range(2):  # warm-up (compiled: every graph this generation needs is built here)
        engine.generate(ids, max_new)
    if ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            g = engine.generate(ids, max_new)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    else:
        prof = cProfile.Profile()
        prof.enable()
        g = engine.generate(ids, max_new)
        prof.disable()
    print(f"steps {g.steps} draft {1e3 * g.draft_s / g.steps:.1f} ms/step verify {1e3 * g.verify_s / g.steps:.1f} ms/step")
    if ops:
        print(table)
    else:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    args = sys.argv[1:]
    flags = {a for a in args if a in ("compile", "ops")}
    rest = [a for a in args if a not in flags]
    main(*(rest[:1] or ["eagle2"]), *(int(a) for a in rest[1:2]), compiled="compile" in flags, ops="ops" in flags)
