"""Two copies of one experiment's runs, compared run by run: τ and every turn's tokens.

    .venv/bin/python scripts/compare_runs.py <new results/<experiment>> <reference results/<experiment>>

A run is matched by its directory name (the same config gives the same name, specbench/core/records.py), so a
re-run of an experiment into another `out.root` (make bench RESULTS=/tmp/x) is read against the committed records:
issue 77's "Table 1 re-run on the one path" (docs/engine.md). Prints a markdown table (τ micro of each run, the
change, the re-run's lossless check against its own baseline) and the count of turns whose tokens equal the
reference's; exits 1 when a turn differs. Runs present on one side only are named, not compared.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def turns(run: Path) -> dict[tuple, list[int]]:
    """A run's new tokens per (question, turn, repeat)."""
    with open(run / "records.jsonl") as f:
        return {(r["question_id"], r["turn"], r["repeat"]): r["new_token_ids"] for r in map(json.loads, f)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", type=Path)
    ap.add_argument("reference", type=Path)
    args = ap.parse_args(argv)
    for d in (args.new, args.reference):
        if not d.is_dir():
            sys.exit(f"compare_runs: {d} is not a directory")
    print("| drafter | dataset | τ reference | τ new | change | lossless (new) |")
    print("|---|---|---|---|---|---|")
    same, differ, alone = 0, [], []
    for run in sorted(p for p in args.new.iterdir() if (p / "summary.json").exists()):
        ref = args.reference / run.name
        if not (ref / "summary.json").exists():
            alone.append(run.name)
            continue
        a, b = (json.loads((p / "summary.json").read_text()) for p in (run, ref))
        ll = a.get("lossless")
        ll = f"{ll['matches']}/{ll['compared']}" if isinstance(ll, dict) else "–"
        print(f"| {a['drafter']} | {a['dataset']} | {b['tau_micro']:.3f} | {a['tau_micro']:.3f} | "
              f"{100 * (a['tau_micro'] / b['tau_micro'] - 1):+.1f}% | {ll} |")
        new_t, ref_t = turns(run), turns(ref)
        for k in sorted(new_t.keys() & ref_t.keys()):
            if new_t[k] == ref_t[k]:
                same += 1
            else:
                differ.append(f"{run.name} {k}")
    print(f"\nturns with the reference's tokens: {same}; differing: {len(differ)}")
    for name in differ:
        print("  differs:", name)
    for name in alone:
        print("  no reference run:", name)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
