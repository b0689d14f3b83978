"""One greedy generation of a drafter on the embedded target under cProfile, after a warm-up: draft and verify ms per
step and where the time goes. The README's before/after alternation ran it at each commit in turn:

    python scripts/profile_step.py [drafter=eagle2] [max_new_tokens=64]
"""
from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from specbench.config import register_schema
from specbench.engine import Engine
from specbench.run import Runner


def main(drafter: str = "eagle2", max_new: int = 64) -> None:
    register_schema()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"drafter={drafter}", "dataset.limit=1"])
    runner = Runner(cfg)
    engine = Engine(runner.target, runner.make_drafter(cfg.drafter), runner.decoding.sampling())
    ids = runner.prompt_ids(runner.questions[0], 0, [])
    engine.generate(ids, 32)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    g = engine.generate(ids, max_new)
    prof.disable()
    print(f"steps {g.steps} draft {1e3 * g.draft_s / g.steps:.1f} ms/step verify {1e3 * g.verify_s / g.steps:.1f} ms/step")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["eagle2"]), *(int(a) for a in sys.argv[2:3]))
