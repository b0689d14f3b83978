"""Batch 1 tokens/s of one drafter in two source trees, paired process by process (issue 77's 0.97x bar).

    git worktree add ../before 9bfb792                      # the lone-row path, beside this tree
    .venv/bin/python scripts/pair_b1.py ../before eagle2 --pairs 4

Each process decodes the first cpu-preset question once (32 new tokens, a warm-up), then three times with 64 new
tokens at T = 0, and reports the mean wall seconds of the three and the new tokens. Processes alternate, this tree
then the other, after one uncounted pair; tokens/s this / other is taken pair by pair, so that the host's drift,
which moves this machine's speed by 10-20% within minutes, falls on both sides of each pair.

Each process imports the specbench of the tree it runs in: the timer runs as `python -c` with that tree as its
working directory, which puts the tree first on sys.path (a script file would put its own folder there, and the
editable install would hand it this checkout's package whatever the working directory).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TIMER = r"""
import json, sys, torch, specbench
from hydra import compose, initialize_config_dir
from specbench.core.cli import CONF_DIR
from specbench.core.config import register_schema
from specbench.bench.run import Runner
from specbench.decode.engine import Engine

drafter, max_new = sys.argv[1], int(sys.argv[2])
register_schema()
with initialize_config_dir(str(CONF_DIR), version_base=None):
    cfg = compose("perf_drafters", overrides=["dataset.limit=1"])
    runner = Runner(cfg)
    node = compose("config", overrides=[f"model={cfg.model.name}", f"drafter={drafter}"]).drafter
torch.manual_seed(0)
engine = Engine(runner.target, runner.make_drafter(node), runner.decoding.sampling())
ids = runner.prompt_ids(runner.questions[0], 0, [])
engine.generate(ids, min(max_new, 32))
gens = [engine.generate(ids, max_new) for _ in range(3)]
ops = {}
if len(sys.argv) > 3:  # one more answer under the torch profiler: every operator's calls and self CPU microseconds
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(ids, max_new)
    ops = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()}
print(json.dumps({"tree": specbench.__file__, "wall_s": sum(g.wall_s for g in gens) / 3,
                  "tokens": gens[0].new_tokens, "steps": gens[0].steps, "ops": ops}))
"""


def timed(tree: Path, drafter: str, max_new: int, ops: bool = False) -> dict:
    """One process in `tree`: its JSON line (a failing process ends the pairing with its stderr's tail)."""
    argv = [sys.executable, "-c", TIMER, drafter, str(max_new), *(["ops"] if ops else [])]
    p = subprocess.run(argv, cwd=tree, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"the timer failed in {tree}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def print_ops(this: dict, other: dict) -> None:
    """The operators that tell the two trees' work apart (the profiled answer of the uncounted pair)."""
    print(f"operator time: this {sum(v[1] for v in this.values()) / 1e3:.0f} ms, "
          f"other {sum(v[1] for v in other.values()) / 1e3:.0f} ms; calls {sum(v[0] for v in this.values())} "
          f"against {sum(v[0] for v in other.values())}")
    rows = [(k, other.get(k, [0, 0]), this.get(k, [0, 0])) for k in sorted(set(this) | set(other))]
    rows = [r for r in rows if r[1][0] != r[2][0] or abs(r[1][1] - r[2][1]) > 20_000]
    for k, (co, to), (ct, tt) in sorted(rows, key=lambda r: -abs(r[2][1] - r[1][1])):
        print(f"  {k[:56]:56} calls {co:7} -> {ct:7}   self ms {to / 1e3:8.1f} -> {tt / 1e3:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", type=Path, help="the other source tree (a git worktree at the commit to compare)")
    ap.add_argument("drafter")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", type=Path, help="write every process's record here as JSON")
    ap.add_argument("--ops", action="store_true", help="profile one more answer in the uncounted pair and print the "
                    "operators whose calls differ or whose self time differs by over 20 ms")
    args = ap.parse_args()
    this, other = Path(__file__).resolve().parents[1], args.other.resolve()
    if args.pairs < 1:
        sys.exit(f"--pairs {args.pairs}: at least one counted pair")
    if not (other / "specbench").is_dir():
        sys.exit(f"{other} is not a specbench source tree (no specbench/ in it)")
    runs = []
    for i in range(args.pairs + 1):  # pair 0 is the uncounted warm-up
        a, b = (timed(tree, args.drafter, args.max_new, args.ops and i == 0) for tree in (this, other))
        runs.append({"pair": i, "this": a, "other": b})
        if i == 0 and args.ops:
            print_ops(a["ops"], b["ops"])
        if i:
            print(f"pair {i}: this {a['wall_s']:.2f} s, other {b['wall_s']:.2f} s, this/other tokens/s "
                  f"{b['wall_s'] / a['wall_s']:.3f}", flush=True)
    counted = runs[1:]
    ratios = [r["other"]["wall_s"] / r["this"]["wall_s"] for r in counted]
    same = all(r["this"]["tokens"] == r["other"]["tokens"] for r in runs)
    print(f"{args.drafter}: this/other tokens/s, {len(ratios)} pairs: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; same tokens: {same}")
    if args.out:
        args.out.write_text(json.dumps({"drafter": args.drafter, "this": str(this), "other": str(other),
                                        "ratios": ratios, "same_tokens": same, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
